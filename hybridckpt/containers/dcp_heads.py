"""Matched heads of `TensorStorageMetadata` values in a DCP `.metadata` pickle.

Each entry of `Metadata.state_dict_metadata` is pickled (protocol 4) as its key, then
`TensorStorageMetadata(properties=TensorProperties(...), size=torch.Size(...), chunks=[...])`:

    <key> MEMOIZE  BINGET TensorStorageMetadata EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK
    BINGET 'properties' (BINGET TensorProperties EMPTY_TUPLE NEWOBJ MEMOIZE MARK <5 values> TUPLE
    MEMOIZE BUILD | BINGET <a TensorProperties>) BINGET 'size' (BINGET torch.Size <ints> TUPLEn
    MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE | BINGET <a Size>) BINGET 'chunks' EMPTY_LIST MEMOIZE

then the chunks (matched records, `dcp_records`: after a MARK, or here when the list holds one
chunk, pickled without a MARK and APPENDed) and `APPENDS SETITEMS BUILD`. Read opcode by
opcode that head is ~35 turns of the loop a tensor (a Megatron torch_dist save of Llama 3.1
405B has 9321 tensors: ~330k opcodes, most of the loop's work at every rank count). Here one
compiled pattern matches it, and `tensor_head` does exactly what the loop would have done: the
same objects made by the same calls (stub classes' `__new__`, `__setstate__`, the policy's
`torch.Size`), the same memo entries in the same order (`Records.memoize`), the same stack and
marks; every fetch through `Records.fetch`. Its class and field-name fetches must hold the
names (`_holds`; a tuple of fetch bytes seen good once is good for good, memo entries are never
replaced), else nothing is consumed and the loop reads it.
"""

from __future__ import annotations

import re

from hybridckpt.containers.dcp_plans import _BODY, _F, _ONE, _at, _holds
from hybridckpt.containers.dcp_records import _SIZE, Fallback, _size_value

# what each named fetch must hold: a field name or a class (its stub name)
EXPECT = {"tsm": ("TensorStorageMetadata",), "k_props": "properties", "tp": ("TensorProperties",),
          "k_size": "size", "size": ("Size",), "k_chunks": "chunks"}
_NAMES = tuple(EXPECT)

HEAD = re.compile(
    rb"\x94" + _F % b"tsm" + rb"\)\x81\x94\}\x94\(" + _F % b"k_props"
    + rb"(?:" + _F % b"tp" + rb"\)\x81\x94\((?P<pargs>" + _ONE + rb"{5})t\x94b|" + _F % b"props_f" + rb")"
    + _F % b"k_size" + rb"(?:" + _F % b"size" + _BODY % b"s" + rb"|" + _F % b"size_f" + rb")"
    + _F % b"k_chunks" + rb"\]\x94"
)
_VALUES = re.compile(rb"h[\s\S]|j[\s\S]{4}|[\x88\x89N]")
_CONST = {0x88: True, 0x89: False, 0x4E: None}


def tensor_head(rec, pos: int) -> int:
    """The head of a `TensorStorageMetadata` at `pos` (the MEMOIZE after its key string, which is
    on the stack), done as the loop would do it; where the loop goes on (`pos` when no head is
    there: nothing consumed)."""
    m = HEAD.match(rec.buf, pos)
    if m is None:
        return pos
    key = m.group(*_NAMES)
    if key not in rec.heads_good:
        if any(k is not None and not _holds(rec, _at(k), w) for k, w in zip(key, EXPECT.values(), strict=True)):
            return pos
        if len(rec.heads_good) < 1 << 12:
            rec.heads_good.add(key)
    rec.frames_in(pos, m.end())
    rec.heads_matched += 1
    stack, memoize, fetch = rec.stack, rec.memoize, rec.fetch
    memoize(stack[-1])  # the key
    cls = fetch(_at(key[0]))
    obj = cls.__new__(cls)
    memoize(obj)
    d = {}
    memoize(d)
    stack += (obj, d)
    rec.marks.append(len(stack))
    stack.append(fetch(_at(key[1])))
    if key[2] is not None:  # a TensorProperties made here
        tp = fetch(_at(key[2]))
        props = tp.__new__(tp)
        memoize(props)
        state = tuple(fetch(_at(v)) if v[0] in (0x68, 0x6A) else _CONST[v[0]]
                      for v in _VALUES.findall(m.group("pargs")))
        memoize(state)
        props.__setstate__(state)
    else:
        props = fetch(_at(m.group("props_f")))
    stack += (props, fetch(_at(key[3])))
    if key[4] is not None:  # a torch.Size made here
        if fetch(_at(key[4])) is not _SIZE:
            raise Fallback
        dims = _size_value(m, m.re.groupindex["s_run"], rec.size_cache)
        if dims:
            memoize(dims)
        args = (dims,)
        memoize(args)
        size = _SIZE(*args)
        memoize(size)
    else:
        size = fetch(_at(m.group("size_f")))
    lst = []
    stack += (size, fetch(_at(key[5])), lst)
    memoize(lst)
    e = m.end()
    if rec.buf[e : e + 1] != b"(":  # one chunk, then APPEND (no MARK: the loop would not match it)
        return rec.chunks(e)
    return e
