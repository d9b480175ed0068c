"""Matched write items of the save plans megatron-core pickles into its `.metadata`.

Megatron-Core's `torch_dist` `.metadata` holds every rank's `SavePlan` (`Metadata.all_local_plans`,
about half the pickle): one `WriteItem(index=MetadataIndex(fqn, index[, offset]), type=...,
bytes_io_data=None, tensor_data=TensorWriteData(chunk, properties, size) | None)` per chunk,
its chunk, properties and size objects, and its type, fetched from the memo. No reader needs
them (`dcp_stubs.extract` reads `state_dict_metadata`, `storage_data`, `planner_data`,
`version`, `storage_meta`), but the general machine builds ~10 objects per item.

Once the memo holds the classes and field names, one compiled pattern of those exact bytes
(`item_pattern`) matches a whole item: every memo entry it makes is counted (its new fqn string
kept; its sizes and properties rebuilt from the item's bytes only when fetched, `item_entry`;
the other objects not: fetching one falls back), every memo fetch in it must name an entry the
general machine would have, its numbers pass the same bounds, and `_ITEM` goes on the stack.
`_ITEM` may only be appended to a list (`dcp_fast._into`, which registers the list in
`plan_lists`); `dcp_fast.read` checks that each such list is a plan's `items` in
`all_local_plans` and that no `_ITEM` reached what `extract` returns, else Fallback.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from operator import itemgetter

from hybridckpt.containers.dcp_records import (
    _INT,
    _MISSING,
    _OBJ,
    _SIZE,
    _TUPLE_N,
    Fallback,
    _check,
    _int_run,
    _Row,
    _size_value,
)
from hybridckpt.containers.pickle.allow import Stub

_ITEM = _Row(())  # a matched write item on the stack (never a chunk or storage row: len 0)

_F = rb"(?P<%s>h[\s\S]|j[\s\S]{4})"  # BINGET i | LONG_BINGET i, named
_BODY = rb"(?:\)|(?P<%s_run>" + _INT + rb"{1,3})([\x85\x86\x87])\x94|\((" + _INT + rb"{4,64})t\x94)\x85\x94R\x94"
_ONE = rb"(?:h[\s\S]|j[\s\S]{4}|\x88|\x89|N)"

# what each named fetch must hold: a field name (str) or a class (its stub name; "Size": torch.Size)
EXPECT = {
    "k_index": "index", "k_index2": "index", "k_fqn": "fqn", "k_offset": "offset", "k_type": "type",
    "k_bio": "bytes_io_data", "k_td": "tensor_data", "k_chunk": "chunk", "k_props": "properties",
    "k_size": "size", "wi": ("WriteItem",), "mi": ("MetadataIndex",), "twd": ("TensorWriteData",),
    "tp": ("TensorProperties",), "size1": ("Size",), "size2": ("Size",),
}


def item_pattern(_known=None) -> re.Pattern:
    """A `WriteItem` record; every class and field name a fetch (`EXPECT` says what it must
    hold: megatron's plans fetch per-rank copies of the names)."""
    text = rb"(?:\x8c(?P<fqn_n>[\s\S])(?P<fqn_t>[\s\S]{0,255}?)\x94|" + _F % b"fqn_f" + rb")"
    props = (rb"(?:" + _F % b"props" + rb"|" + _F % b"tp" + rb"\)\x81\x94\((?P<pargs>" + _ONE + rb"{5})t\x94b)")
    twd = (
        _F % b"twd" + _OBJ + _F % b"k_chunk" + _F % b"chunk" + _F % b"k_props" + props + _F % b"k_size"
        + rb"(?:" + _F % b"size2" + _BODY % b"s" + rb"|" + _F % b"size_f" + rb")ub"
    )
    return re.compile(
        _F % b"wi" + _OBJ + _F % b"k_index" + _F % b"mi" + _OBJ + _F % b"k_fqn" + text
        + _F % b"k_index2" + rb"(?P<idx>N|" + _INT + rb")(?:" + _F % b"k_offset" + _F % b"size1" + _BODY % b"o"
        + rb")?ub" + _F % b"k_type" + _F % b"type" + _F % b"k_bio" + rb"N" + _F % b"k_td"
        + rb"(?:(?P<notd>N)|" + twd + rb")ub"
    )


def _at(b: bytes) -> int:
    """The memo index of a matched BINGET / LONG_BINGET."""
    return b[1] if b[0] == 0x68 else int.from_bytes(b[1:5], "little")


def _holds(rec, i: int, want) -> bool:
    """Whether memo entry `i` (kept) is the field name or class `want`; cached per index."""
    got = rec.checked.get(i)
    if got is None:
        v = rec.memo.get(i, _MISSING)
        if type(v) is str:
            got = v
        elif v is _SIZE:
            got = ("Size",)
        elif isinstance(v, type) and issubclass(v, Stub):
            got = (v.stub_name,)
        else:
            return False
        rec.checked[i] = got
    return got == want


_NAMES = tuple(EXPECT)
_FETCHED = ("fqn_f", "type", "props", "size_f")  # fetches of entries that must exist (validity cached)


def plan_items(rec, pos: int) -> int:
    """Write items from `pos` on (`rec`: a `dcp_records.Records`), each pushed as `_ITEM`;
    where the first not matched is (left to the opcode loop: nothing of it counted yet). A
    fetch of an entry this reader does not hold falls back.

    Checked here, as each item is matched: its class and field-name fetches (`EXPECT`; a tuple
    of fetch bytes once seen good is good for good: memo entries are never replaced), its other
    fetches naming entries the general machine holds (`_exists`, cached the same way), its
    numbers and its fqn's text. Kept: the fqn string (in the memo); the entries the general
    machine would hold for its sizes and properties are NOT made here: the item's start and memo
    base go to `item_idx` / `item_pos`, and `item_entry` rebuilds them from its bytes when one
    is fetched (no real file does: 0 of 394k at 288 ranks)."""
    pattern = rec.item_pattern
    buf, push, cache = rec.buf, rec.stack.append, rec.size_cache
    memo, good, ok = rec.memo, rec.items_good, rec.fetch_good
    chunk_idx = rec.chunk_idx
    gi = {k: v - 1 for k, v in pattern.groupindex.items()}  # indices into `m.groups()`
    names_of = itemgetter(*(gi[k] for k in _NAMES))
    i_fetched = tuple(gi[k] for k in _FETCHED)
    i_fqn_n, i_fqn_t, i_idx, i_size1, i_notd, i_tp, i_size2, i_chunk, i_pargs, i_o, i_s = (gi[k] for k in (
        "fqn_n", "fqn_t", "idx", "size1", "notd", "tp", "size2", "chunk", "pargs", "o_run", "s_run"))
    idx_at, pos_at = rec.item_idx, rec.item_pos
    n_items = 0
    while True:
        m = pattern.match(buf, pos)
        if m is None:
            break
        G = m.groups()
        key = names_of(G)
        if key not in good:
            if any(k is not None and not _holds(rec, _at(k), w) for k, w in zip(key, EXPECT.values(), strict=True)):
                break
            if len(good) < 1 << 12:
                good.add(key)
        fqn_n = G[i_fqn_n]
        if fqn_n is not None and len(G[i_fqn_t]) != fqn_n[0]:
            break  # a fqn holding a MEMOIZE byte: the opcode loop reads it
        n0 = rec.memo_n
        # fetch bytes (h / j ...), TensorProperties states (h / j / True / False / None ...) and
        # index ints (K / M / J / LONG1 ...) seen good: one set, their first bytes tell them apart
        idx = G[i_idx]
        if idx != b"N" and idx not in ok:
            _check(_int_run(idx))
            if len(ok) < 1 << 16:
                ok.add(idx)
        for i in i_fetched:
            f = G[i]
            if f is not None and f not in ok:
                _exists(rec, _at(f), n0)
                if len(ok) < 1 << 16:
                    ok.add(f)
        n = n0 + 4  # WriteItem and its dict, MetadataIndex and its dict (not kept)
        if fqn_n is not None:
            try:
                memo[n] = G[i_fqn_t].decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise Fallback from None
            n += 1
        if G[i_size1] is not None:
            n += _size_entries(m, G, i_o, cache)
        if G[i_notd] is None:
            n += 2  # TensorWriteData and its dict (not kept)
            c = _at(G[i_chunk])
            k = bisect_left(chunk_idx, c)
            if k == len(chunk_idx) or chunk_idx[k] != c:  # not a matched chunk: any entry held
                _exists(rec, c, n0)
            if G[i_tp] is not None:
                pargs = G[i_pargs]
                if pargs not in ok:
                    for op in re.findall(rb"h[\s\S]|j[\s\S]{4}", pargs):
                        _exists(rec, _at(op), n0)
                    if len(ok) < 1 << 16:
                        ok.add(pargs)
                n += 2
            if G[i_size2] is not None:
                n += _size_entries(m, G, i_s, cache)
        idx_at.append(n0)
        pos_at.append(pos)
        rec.memo_n = n
        e = m.end()
        rec.frames_in(pos, e)
        push(_ITEM)
        n_items += 1
        pos = e
    rec.items_matched += n_items
    return pos


def item_entry(rec, i: int):
    """Memo entry `i` if a matched write item made it and the general machine would hold it
    there (a size's tuples and `torch.Size`, a TensorProperties and its state), rebuilt from the
    item's bytes and put in the memo (a second fetch gets the same object); else `_MISSING`."""
    k = bisect_right(rec.item_idx, i) - 1
    if k < 0:
        return _MISSING
    n0, pos = rec.item_idx[k], rec.item_pos[k]
    m = rec.item_pattern.match(rec.buf, pos)
    d, cache = m.groupdict(), rec.size_cache
    gi = rec.item_pattern.groupindex
    n = n0 + 4 + (d["fqn_n"] is not None)
    keep = []  # (memo index, the object the general machine would hold there)
    if d["size1"] is not None:
        n = _size_memo(_size_value(m, gi["o_run"], cache), n, keep)
    if d["notd"] is None:
        n += 2
        if d["tp"] is not None:
            state = tuple(_one(rec, op, n0) for op in re.findall(rb"h[\s\S]|j[\s\S]{4}|[\x88\x89N]", d["pargs"]))
            cls = rec.memo[_at(d["tp"])]
            obj = cls.__new__(cls)
            obj.__setstate__(state)
            keep += [(n, obj), (n + 1, state)]
            n += 2
        if d["size2"] is not None:
            n = _size_memo(_size_value(m, gi["s_run"], cache), n, keep)
    for j, v in keep:
        rec.memo[j] = v
    return rec.memo.get(i, _MISSING)


def _size_entries(m: re.Match, G: tuple, i: int, cache: dict) -> int:
    """The memo entries a matched `torch.Size` makes (3, or 2 when empty: no dims tuple), its
    dims checked (`_size_value`; a run seen before, of the right length, is good)."""
    run = G[i]
    if run is not None:
        dims = cache.get(run)
        if dims is not None and len(dims) == _TUPLE_N[G[i + 1][0]]:
            return 3
    return 3 if _size_value(m, i + 1, cache) else 2


def _size_memo(dims: tuple, n: int, keep: list) -> int:
    """The memo entries of a `torch.Size(dims)` made at `n` (the dims tuple unless empty, the
    args tuple, the Size the policy's REDUCE returns) into `keep`; the memo's size after."""
    if dims:
        keep.append((n, dims))
        n += 1
    keep += [(n, (dims,)), (n + 1, _SIZE(dims))]
    return n + 2


def _one(rec, op: bytes, n: int):
    """The value of one opcode of a TensorProperties state: a fetch (checked), True, False, None."""
    if op[0] in (0x68, 0x6A):
        i = _at(op)
        _exists(rec, i, n)
        return rec.fetch(i)
    return {0x88: True, 0x89: False, 0x4E: None}[op[0]]


def _exists(rec, i: int, n: int) -> None:
    """Fallback unless memo entry `i` is one the general machine would hold and this reader
    knows (kept, a matched record's string, or a matched chunk); `n`: the memo's size now."""
    if i >= n:
        raise Fallback
    if i in rec.memo:
        return
    for arr in (rec.hot_idx, rec.chunk_idx):
        k = bisect_left(arr, i)
        if k < len(arr) and arr[k] == i:
            return
    if item_entry(rec, i) is _MISSING:
        raise Fallback

