"""The specialised reader of DCP `.metadata` pickles: millions of chunks, no object per chunk.

`pickle.dump(metadata)` (torch's `FileSystemWriter.finish`, protocol 4) writes each chunk as
`ChunkStorageMetadata(offsets=torch.Size(...), sizes=torch.Size(...))` and each storage entry
as `MetadataIndex(fqn, index, offset) -> _StorageInfo(relative_path, offset, length)`: the same
few dozen opcodes over and over, the classes and field names fetched from the memo. The general
machine (`containers.pickle.machine`: an opcode walk for its guards, then the C unpickler with
stub classes) builds ~15 objects per chunk; at 873k chunks that is 3x torch's own time and as
much memory.

This reader runs the same pickle as a small stack machine over a strict subset of opcodes
(`_ops`: strings, ints, floats, None/bools, tuples, lists, dicts, MARK, MEMOIZE, BINGET,
STACK_GLOBAL, NEWOBJ, REDUCE, BUILD, STOP), resolving every global through the same allow-list
policy and calling the same policy objects (`DCP_POLICY`: stub classes, `torch.Size`, ...) the
general machine calls; NEWOBJ only on stub classes, REDUCE only on stubs and the policy's frozen
functions, BUILD only on stubs. Where a chunk or a storage entry starts and the memo already holds
its class and field names, one compiled pattern of those exact bytes (`_chunk_pattern`, `_EntryPatterns`) matches the
whole record and its numbers go straight into `RawTables` columns (a placeholder on the stack
until APPENDS / SETITEMS put them in order); anything else runs opcode by opcode. Entries a
matched record memoizes are not kept (only its strings): a later fetch of one, and every opcode,
shape or value outside the subset, raises `Fallback`, and the caller reads the file with the
general machine instead (so every error message, and every accepted file's meaning, is the
general machine's; `tests/containers/test_dcp_fast.py` shows both agree).

Frames (protocol 4: `FRAME n` then n bytes of opcodes) are walked first and removed; each frame
must begin where an opcode of the stream begins, as the C unpickler reads them (else Fallback).
"""

from __future__ import annotations

import re
import struct
from array import array
from bisect import bisect_left
from typing import Any

from hybridckpt.containers.dcp_stubs import DCP_POLICY, chunk_row, extract, kind, storage_entry
from hybridckpt.containers.dcp_tables import MAX_DIMS, RawTables
from hybridckpt.containers.pickle.allow import Contextual, Frozen, Stub, stub_class
from hybridckpt.errors import HybridCkptError


class Fallback(Exception):
    """Not the shape this reader knows: read the file with the general machine."""


class _Row:
    """A matched record on the stack: a chunk's `(offsets, sizes)` or a storage entry's
    `(fqn, offsets, path, offset, length)`; `_VALUE` stands for the entry's value half."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data


_VALUE = _Row(None)
_MISSING = object()
_LIMIT = 1 << 62  # numbers above this are refused (by the general machine's reader)

# the field names and classes a record template is built from
_FIELDS = ("offsets", "sizes", "fqn", "index", "offset", "relative_path", "length")
_CLASSES = ("ChunkStorageMetadata", "MetadataIndex", "_StorageInfo")
_SIZE = DCP_POLICY.allowed[("torch", "Size")]

# -- byte patterns ------------------------------------------------------------------------------

_INT = (
    rb"(?:K[\s\S]|M[\s\S]{2}|J[\s\S]{4}|"
    + b"|".join(b"\\x8a\\x%02x[\\s\\S]{%d}" % (n, n) for n in range(1, 9))
    + rb")"
)
_STR_OR_GET = rb"(?:\x8c([\s\S])|h([\s\S])|j([\s\S]{4}))"  # SHORT_BINUNICODE n | BINGET | LONG_BINGET


def _get(i: int) -> bytes:
    """The bytes the pickler writes to fetch memo entry `i`."""
    return re.escape(b"h" + bytes([i]) if i < 256 else b"j" + i.to_bytes(4, "little"))


def _size(s: bytes) -> bytes:
    """`torch.Size(ints)` from the memo's `torch.Size` (`s`): the ints as a run, then the tuple op."""
    return s + rb"(?:\)|(" + _INT + rb"{1,3})([\x85\x86\x87])\x94|\((" + _INT + rb"{4,64})t\x94)\x85\x94R\x94"


_CHUNK_KEYS = ("ChunkStorageMetadata", "offsets", "sizes", "Size")
_ENTRY_KEYS = ("MetadataIndex", "fqn", "index", "offset", "Size", "_StorageInfo", "relative_path", "length")
_OBJ = rb"\)\x81\x94\}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK


def _chunk_pattern(idx: dict) -> re.Pattern:
    """A `ChunkStorageMetadata(offsets=Size, sizes=Size)` record, its class, field names and
    `torch.Size` fetched from memo entries `idx`."""
    g = {k: _get(idx[k]) for k in _CHUNK_KEYS}
    size = _size(g["Size"])
    return re.compile(g["ChunkStorageMetadata"] + _OBJ + g["offsets"] + size + g["sizes"] + size + rb"ub")


class _EntryPatterns:
    """A storage entry `MetadataIndex(fqn, index[, offset]) -> _StorageInfo(relative_path,
    offset, length)` in three parts (its two strings lie between them), for memo entries `idx`."""

    def __init__(self, idx: dict):
        g = {k: _get(idx[k]) for k in _ENTRY_KEYS}
        self.key_head = re.compile(g["MetadataIndex"] + _OBJ + g["fqn"] + _STR_OR_GET)
        self.key_tail = re.compile(
            g["index"] + rb"(N|" + _INT + rb")(" + g["offset"] + _size(g["Size"]) + rb")?ub"
            + g["_StorageInfo"] + _OBJ + g["relative_path"] + _STR_OR_GET
        )
        self.value_tail = re.compile(g["offset"] + rb"(" + _INT + rb")" + g["length"] + rb"(" + _INT + rb")ub")
        # the whole record at once, each string as its length, then bytes up to a MEMOIZE: the
        # length is checked after the match (else the record is read in three parts)
        text = rb"(?:\x8c([\s\S])([\s\S]*?)\x94|h([\s\S])|j([\s\S]{4}))"
        self.whole = re.compile(
            g["MetadataIndex"] + _OBJ + g["fqn"] + text
            + g["index"] + rb"(N|" + _INT + rb")(" + g["offset"] + _size(g["Size"]) + rb")?ub"
            + g["_StorageInfo"] + _OBJ + g["relative_path"] + text
            + g["offset"] + rb"(" + _INT + rb")" + g["length"] + rb"(" + _INT + rb")ub"
        )


def _int_run(run: bytes) -> list[int]:
    """The ints of a run of BININT1 / BININT2 / BININT / LONG1 opcodes (matched by `_INT`)."""
    out, i, n = [], 0, len(run)
    while i < n:
        op = run[i]
        if op == 0x4B:
            out.append(run[i + 1])
            i += 2
        elif op == 0x4D:
            out.append(run[i + 1] | run[i + 2] << 8)
            i += 3
        elif op == 0x4A:
            out.append(int.from_bytes(run[i + 1 : i + 5], "little", signed=True))
            i += 5
        else:
            k = run[i + 1]
            out.append(int.from_bytes(run[i + 2 : i + 2 + k], "little", signed=True))
            i += 2 + k
    return out


def _int1(b: bytes) -> int:
    """The int of one BININT1 / BININT2 / BININT / LONG1 opcode (matched by `_INT`)."""
    op = b[0]
    if op == 0x4B:
        return b[1]
    if op == 0x4D:
        return b[1] | b[2] << 8
    return int.from_bytes(b[1:5] if op == 0x4A else b[2:], "little", signed=True)


_TUPLE_N = {0x85: 1, 0x86: 2, 0x87: 3}


def _size_value(m: re.Match, g: int, cache: dict) -> tuple[int, ...]:
    """The dims of a `_size` match whose groups start at `g` (checked: non-negative, bounded)."""
    run = m.group(g)
    if run is not None:
        dims = cache.get(run)
        if dims is None:
            dims = tuple(_int_run(run))
            if len(dims) != _TUPLE_N[m.group(g + 1)[0]]:
                raise Fallback
            _check(dims)
            if len(cache) < 1 << 16:
                cache[run] = dims
        elif len(dims) != _TUPLE_N[m.group(g + 1)[0]]:
            raise Fallback
        return dims
    run = m.group(g + 2)
    if run is None:
        return ()
    dims = tuple(_int_run(run))
    if len(dims) > MAX_DIMS:
        raise Fallback
    _check(dims)
    return dims


def _check(dims) -> None:
    for d in dims:
        if d < 0 or d >= _LIMIT:
            raise Fallback


# -- frames -------------------------------------------------------------------------------------


def deframe(data: bytearray) -> list[int]:
    """Remove the PROTO and FRAME headers of a protocol 4/5 pickle in place; the frames' starts
    in what is left. Fallback unless the file is PROTO then frames end to end."""
    if len(data) < 2 or data[0] != 0x80 or data[1] not in (4, 5):
        raise Fallback
    pos, w, end, starts = 2, 0, len(data), []
    while pos < end:
        if data[pos] != 0x95 or pos + 9 > end:
            raise Fallback
        n = int.from_bytes(data[pos + 1 : pos + 9], "little")
        if n > end - pos - 9:
            raise Fallback
        starts.append(w)
        data[w : w + n] = data[pos + 9 : pos + 9 + n]
        w += n
        pos += 9 + n
    del data[w:]
    return starts


_OP_LEN = {0x4B: 2, 0x4D: 3, 0x4A: 5, 0x68: 2, 0x6A: 5}


def _opcode_starts(buf, s: int, e: int) -> set[int]:
    """Where the opcodes of a matched record `[s, e)` begin."""
    out, i = set(), s
    while i < e:
        out.add(i)
        op = buf[i]
        i += _OP_LEN.get(op) or (2 + buf[i + 1] if op in (0x8A, 0x8C) else 1)
    return out


# -- the machine --------------------------------------------------------------------------------


class _Machine:
    def __init__(self, buf: bytes, frames: list[int], path: str, raw: RawTables):
        self.buf, self.frames, self.fi = buf, frames, 0
        self.path, self.raw = path, raw
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.memo_n = 0
        self.hot_idx, self.hot_str = array("q"), array("i")  # memoized strings of matched records
        self.known: dict[str, int] = {}
        self.chunk_pattern: re.Pattern | None = None
        self.entry_patterns: _EntryPatterns | None = None
        self.lists: dict[int, list] = {}  # id(list) -> [list, first row, count]
        self.storage: dict[int, dict] = {}  # id(dict) -> the dict storage entries went into
        self.converted: dict[int, Any] = {}  # stubs turned into rows: never built again
        self.size_cache: dict = {}
        self.text_ids: dict[bytes, int] = {}
        self.chunk_class = stub_class("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata")

    # -- memo ---------------------------------------------------------------------------------
    def memoize(self, obj) -> None:
        if type(obj) is _Row:
            raise Fallback
        i = self.memo_n
        self.memo[i] = obj
        self.memo_n = i + 1
        if type(obj) is str and obj in _FIELDS:
            self.known.setdefault(obj, i)
        elif obj is _SIZE:
            self.known.setdefault("Size", i)
        elif isinstance(obj, type) and issubclass(obj, Stub) and obj.stub_name in _CLASSES:
            self.known.setdefault(obj.stub_name, i)
        else:
            return
        if self.chunk_pattern is None and all(k in self.known for k in _CHUNK_KEYS):
            self.chunk_pattern = _chunk_pattern(self.known)
        if self.entry_patterns is None and all(k in self.known for k in _ENTRY_KEYS):
            self.entry_patterns = _EntryPatterns(self.known)

    def fetch(self, i: int):
        v = self.memo.get(i, _MISSING)
        if v is not _MISSING:
            return v
        k = bisect_left(self.hot_idx, i)
        if k < len(self.hot_idx) and self.hot_idx[k] == i:
            return self.raw.strings[self.hot_str[k]]
        raise Fallback  # an entry of a matched record, or none

    def hot_string(self, m: re.Match, g: int, e: int) -> tuple[str, int]:
        """A string a record pattern matched at group `g` (SHORT_BINUNICODE, then MEMOIZE; or a
        fetch of a string): its id in `raw.strings` and where the record goes on."""
        n = m.group(g)
        if n is not None:
            n = n[0]
            s = e + n
            if s >= len(self.buf) or self.buf[s] != 0x94:
                raise Fallback
            try:
                text = self.buf[e:s].decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise Fallback from None
            sid = self.raw.string_id(text)
            self.hot_idx.append(self.memo_n)
            self.hot_str.append(sid)
            self.memo_n += 1
            return sid, s + 1
        i = m.group(g + 1)
        i = i[0] if i is not None else int.from_bytes(m.group(g + 2), "little")
        v = self.fetch(i)
        if type(v) is not str:
            raise Fallback
        return self.raw.string_id(v), e

    # -- frames ---------------------------------------------------------------------------------
    def frames_in(self, s: int, e: int) -> None:
        """Frames starting inside a matched record `(s, e)` must start at one of its opcodes."""
        f = self.frames
        if self.fi < len(f) and f[self.fi] < e:
            starts = _opcode_starts(self.buf, s, e)
            while self.fi < len(f) and f[self.fi] < e:
                if f[self.fi] not in starts:
                    raise Fallback
                self.fi += 1

    # -- matched records --------------------------------------------------------------------------
    def chunks(self, pos: int) -> int:
        """Chunk records from `pos` on, each pushed as a `_Row`; where the first not matched is."""
        pattern, buf, push = self.chunk_pattern, self.buf, self.stack.append
        cache = self.size_cache
        if pattern is None:
            return pos
        while True:
            m = pattern.match(buf, pos)
            if m is None:
                return pos
            offs, sizes = _size_value(m, 1, cache), _size_value(m, 4, cache)
            if len(offs) != len(sizes):
                raise Fallback
            self.memo_n += 8 - (offs == ()) - (sizes == ())  # obj, dict, per size: tuple, 1-tuple, Size
            self.frames_in(pos, m.end())
            push(_Row((offs, sizes)))
            pos = m.end()

    def entries(self, pos: int) -> int:
        """Storage entries (key then value) from `pos` on, each pushed as `_Row`, `_VALUE`."""
        t, buf, push = self.entry_patterns, self.buf, self.stack.append
        if t is None:
            return pos
        cache = self.size_cache
        whole = t.whole.match
        while True:
            m = whole(buf, pos)
            gr = None if m is None else m.groups()
            if gr is None or (gr[0] is not None and len(gr[1]) != gr[0][0]) or (
                gr[9] is not None and len(gr[10]) != gr[9][0]
            ):  # not a record, or one whose string holds a MEMOIZE byte: read in parts
                end = self.entry_in_parts(pos)
                if end is None:
                    return pos
                pos = end
                continue
            idx = gr[4]
            if idx != b"N":
                _check(_int_run(idx))
            self.memo_n += 2  # the MetadataIndex and its dict
            fqn = self.text_id(gr[0], gr[1], gr[2], gr[3])
            offs = None if gr[5] is None else _size_value(m, 7, cache)  # None: a byte item
            self.memo_n += (0 if offs is None else 3 if offs else 2) + 2  # Size; _StorageInfo, dict
            path = self.text_id(gr[9], gr[10], gr[11], gr[12])
            off, length = _int1(gr[13]), _int1(gr[14])
            if off < 0 or length < 0 or off >= _LIMIT or length >= _LIMIT:
                raise Fallback
            e = m.end()
            self.frames_in(pos, e)
            push(_Row((fqn, offs, path, off, length)))
            push(_VALUE)
            pos = e

    def text_id(self, n, text, b1, j4) -> int:
        """The id in `raw.strings` of a record's string: a SHORT_BINUNICODE (memoized next) or a
        fetch of a string."""
        if n is not None:
            sid = self.text_ids.get(text)
            if sid is None:
                try:
                    sid = self.raw.string_id(text.decode("utf-8", "surrogatepass"))
                except UnicodeDecodeError:
                    raise Fallback from None
                if len(self.text_ids) < 1 << 20:
                    self.text_ids[text] = sid
            self.hot_idx.append(self.memo_n)
            self.hot_str.append(sid)
            self.memo_n += 1
            return sid
        v = self.fetch(b1[0] if b1 is not None else int.from_bytes(j4, "little"))
        if type(v) is not str:
            raise Fallback
        return self.raw.string_id(v)

    def entry_in_parts(self, pos: int) -> int | None:
        """One storage entry at `pos` in three matches (its strings read between them), pushed
        like `entries` does; where it ends, or None when no entry starts there."""
        t, buf = self.entry_patterns, self.buf
        m = t.key_head.match(buf, pos)
        if m is None:
            return None
        self.memo_n += 2  # the MetadataIndex and its dict
        fqn, e = self.hot_string(m, 1, m.end())
        m = t.key_tail.match(buf, e)
        if m is None:
            raise Fallback  # half a record consumed: no way back but the general machine
        idx = m.group(1)
        if idx != b"N":
            _check(_int_run(idx))
        offs = None if m.group(2) is None else _size_value(m, 3, self.size_cache)  # None: a byte item
        self.memo_n += (0 if offs is None else 3 if offs else 2) + 2  # Size; _StorageInfo, dict
        path, e = self.hot_string(m, 6, m.end())
        m = t.value_tail.match(buf, e)
        if m is None:
            raise Fallback
        off, length = _int1(m.group(1)), _int1(m.group(2))
        _check((off, length))
        self.frames_in(pos, m.end())
        self.stack.append(_Row((fqn, offs, path, off, length)))
        self.stack.append(_VALUE)
        return m.end()

    # -- rows in order -----------------------------------------------------------------------------
    def append_rows(self, lst: list, items: list) -> None:
        raw = self.raw
        reg = self.lists.get(id(lst))
        if reg is None:
            if lst:
                raise Fallback
            reg = self.lists[id(lst)] = [lst, len(raw.c_nd), 0]
        if reg[1] + reg[2] != len(raw.c_nd):
            raise Fallback  # rows of this list would not be consecutive
        for x in items:
            if type(x) is _Row:
                if x is _VALUE or len(x.data) != 2:
                    raise Fallback
                raw.add_chunk(*x.data)
            else:
                self.convert(x)
                try:
                    chunk_row(raw, x, self.path)
                except HybridCkptError:
                    raise Fallback from None
        reg[2] = len(raw.c_nd) - reg[1]

    def set_entries(self, d: dict, pairs: list) -> None:
        raw = self.raw
        if id(d) not in self.storage:
            if d or self.storage:
                raise Fallback  # one storage dict, fresh
            self.storage[id(d)] = d
        for k, v in pairs:
            if type(k) is _Row:
                if v is not _VALUE or k is _VALUE or len(k.data) != 5:
                    raise Fallback
                fqn, offs, path, off, length = k.data
                raw.s_fqn.append(fqn)
                if offs is None:
                    raw.s_nd.append(-1)
                else:
                    raw.s_nd.append(len(offs))
                    raw.s_coords.extend(offs)
                raw.s_path.append(path)
                raw.s_off.append(off)
                raw.s_len.append(length)
            else:
                if type(v) is _Row:
                    raise Fallback
                self.convert(k)
                self.convert(v)
                try:
                    storage_entry(raw, k, v, self.path)
                except HybridCkptError:
                    raise Fallback from None

    def convert(self, obj) -> None:
        self.converted[id(obj)] = obj

    # -- the loop -------------------------------------------------------------------------------
    def run(self):
        buf, stack, marks = self.buf, self.stack, self.marks
        end = len(buf)
        pos = 0
        frames, nf = self.frames, len(self.frames)
        while True:
            if self.fi < nf and frames[self.fi] <= pos:
                if frames[self.fi] < pos:
                    raise Fallback  # a frame starts inside an opcode
                self.fi += 1
            if pos >= end:
                raise Fallback
            op = buf[pos]
            pos += 1
            if op == 0x94:  # MEMOIZE
                if not stack:
                    raise Fallback
                self.memoize(stack[-1])
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                nxt = buf[pos : pos + 1]
                if nxt == b"h" or nxt == b"j":  # a batch of list items or dict entries
                    pos = self.chunks(pos)
                    pos = self.entries(pos)
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                if op == 0x68:
                    i, pos = buf[pos], pos + 1
                else:
                    i, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
                stack.append(self.fetch(i))
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = buf[pos]
                stack.append(self._text(pos + 1, n))
                pos += 1 + n
            elif op == 0x58 or op == 0x8D:  # BINUNICODE, BINUNICODE8
                w = 4 if op == 0x58 else 8
                n = int.from_bytes(buf[pos : pos + w], "little")
                stack.append(self._text(pos + w, n))
                pos += w + n
            elif op == 0x4B:  # BININT1
                stack.append(buf[pos])
                pos += 1
            elif op == 0x4D:  # BININT2
                stack.append(buf[pos] | buf[pos + 1] << 8)
                pos += 2
            elif op == 0x4A:  # BININT
                stack.append(int.from_bytes(buf[pos : pos + 4], "little", signed=True))
                pos += 4
            elif op == 0x8A:  # LONG1
                n = buf[pos]
                stack.append(int.from_bytes(buf[pos + 1 : pos + 1 + n], "little", signed=True))
                pos += 1 + n
            elif op == 0x47:  # BINFLOAT
                stack.append(struct.unpack_from(">d", buf, pos)[0])
                pos += 8
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
                stack.append(op == 0x88)
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
                n = op - 0x84
                if len(stack) < n or (marks and marks[-1] > len(stack) - n):
                    raise Fallback
                items = stack[-n:]
                del stack[-n:]
                stack.append(tuple(self._clean(items)))
            elif op == 0x74:  # TUPLE
                stack.append(tuple(self._clean(self._pop_mark())))
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x61:  # APPEND
                self._append()
            elif op == 0x65:  # APPENDS
                self._appends()
            elif op == 0x73:  # SETITEM
                if len(stack) < 3 or (marks and marks[-1] > len(stack) - 2):
                    raise Fallback
                k, v = stack[-2], stack[-1]
                del stack[-2:]
                self._setitems(stack[-1], [(k, v)])
            elif op == 0x75:  # SETITEMS
                items = self._pop_mark()
                if len(items) % 2 or not stack:
                    raise Fallback
                self._setitems(stack[-1], list(zip(items[::2], items[1::2], strict=True)))
            elif op == 0x93:  # STACK_GLOBAL
                if len(stack) < 2:
                    raise Fallback
                name, module = stack.pop(), stack.pop()
                stack.append(self._global(module, name))
            elif op == 0x81:  # NEWOBJ
                if len(stack) < 2:
                    raise Fallback
                args, cls = stack.pop(), stack.pop()
                if not (isinstance(cls, type) and issubclass(cls, Stub)) or type(args) is not tuple:
                    raise Fallback
                stack.append(cls.__new__(cls, *self._clean(args)))
            elif op == 0x52:  # REDUCE
                if len(stack) < 2:
                    raise Fallback
                args, fn = stack.pop(), stack.pop()
                if type(args) is not tuple or not (
                    isinstance(fn, Frozen) or (isinstance(fn, type) and issubclass(fn, Stub))
                ):
                    raise Fallback
                stack.append(self._call(fn, args))
            elif op == 0x62:  # BUILD
                if len(stack) < 2:
                    raise Fallback
                state = stack.pop()
                inst = stack[-1]
                if not isinstance(inst, Stub):
                    raise Fallback
                if id(inst) in self.converted or type(state) is _Row:
                    raise Fallback
                self._clean(state if isinstance(state, tuple) else (state,))
                inst.__setstate__(state)
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or marks or pos != end:
                    raise Fallback
                if self.fi != nf:
                    raise Fallback
                return stack[0]
            else:
                raise Fallback

    # -- helpers --------------------------------------------------------------------------------
    def _text(self, at: int, n: int) -> str:
        if at + n > len(self.buf):
            raise Fallback
        try:
            return self.buf[at : at + n].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise Fallback from None

    def _pop_mark(self) -> list:
        if not self.marks:
            raise Fallback
        k = self.marks.pop()
        items = self.stack[k:]
        del self.stack[k:]
        return items

    @staticmethod
    def _clean(items):
        for x in items:
            if type(x) is _Row:
                raise Fallback
        return items

    def _append(self) -> None:
        stack, marks = self.stack, self.marks
        if len(stack) < 2 or (marks and marks[-1] > len(stack) - 1):
            raise Fallback
        x = stack.pop()
        self._into(stack[-1], [x])

    def _appends(self) -> None:
        items = self._pop_mark()
        if not self.stack:
            raise Fallback
        self._into(self.stack[-1], items)

    def _into(self, lst, items: list) -> None:
        if type(lst) is not list:
            raise Fallback
        if any(type(x) is _Row or (isinstance(x, Stub) and type(x) is self.chunk_class) for x in items):
            self.append_rows(lst, items)
        elif id(lst) in self.lists:
            raise Fallback
        else:
            lst.extend(items)

    def _setitems(self, d, pairs: list) -> None:
        if type(d) is not dict:
            raise Fallback
        if any(type(k) is _Row or kind(k) == "MetadataIndex" for k, _ in pairs):
            self.set_entries(d, pairs)
        elif id(d) in self.storage:
            raise Fallback
        else:
            for k, v in pairs:
                if type(k) is _Row or type(v) is _Row:
                    raise Fallback
                try:
                    d[k] = v
                except TypeError:
                    raise Fallback from None

    def _global(self, module, name):
        if type(module) is not str or type(name) is not str:
            raise Fallback
        obj = DCP_POLICY.allowed.get((module, name), _MISSING)
        if obj is not _MISSING:
            if isinstance(obj, Contextual):
                raise Fallback
            return obj
        if DCP_POLICY.is_stubbed(f"{module}.{name}"):
            return stub_class(module, name)
        raise Fallback  # the general machine refuses it, naming it

    def _call(self, fn, args):
        self._clean(args)
        try:
            return fn(*args)
        except HybridCkptError:
            raise Fallback from None
        except (TypeError, ValueError, OverflowError):
            raise Fallback from None


def read(data: bytearray, path: str) -> tuple[RawTables, tuple]:
    """`RawTables` of one `.metadata` file's bytes (changed in place) and `extract`'s other
    results (byte item fqns, planner_data, version, written_to); Fallback when the file is not
    the shape this reader knows."""
    frames = deframe(data)
    buf = bytes(data)  # matches and their groups as bytes (hashable)
    data.clear()
    raw = RawTables()
    m = _Machine(buf, frames, path, raw)
    try:
        md = m.run()
    except (IndexError, RecursionError, MemoryError, struct.error):
        raise Fallback from None
    storage = vars(md).get("storage_data") if isinstance(md, Stub) else None
    if type(storage) is not dict or (m.storage and id(storage) not in m.storage):
        raise Fallback
    if storage and id(storage) not in m.storage:
        raise Fallback
    used: dict[int, tuple[int, int]] = {}

    def rows_of(chunks):
        if type(chunks) is not list:
            raise Fallback
        reg = m.lists.get(id(chunks))
        if reg is None:
            if chunks:
                raise Fallback
            return (len(raw.c_nd), 0)
        if id(chunks) in used:
            raise Fallback  # one chunk list in two tensors
        used[id(chunks)] = (reg[1], reg[2])
        return reg[1], reg[2]

    try:
        rest = extract(md, raw, path, rows_of=rows_of, storage_done=True)
    except HybridCkptError:
        raise Fallback from None
    if sum(c for _, c in used.values()) != len(raw.c_nd) or len(used) != len(m.lists):
        raise Fallback  # chunk rows no tensor holds
    return raw, rest
