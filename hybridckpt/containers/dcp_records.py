"""Matched records of the specialised DCP `.metadata` reader (`containers.dcp_fast`).

A chunk `ChunkStorageMetadata(offsets=torch.Size(...), sizes=torch.Size(...))` and a storage
entry `MetadataIndex(fqn, index, offset) -> _StorageInfo(relative_path, offset, length)` are
pickled (protocol 4) as the same few dozen opcodes, their classes and field names fetched from
the memo. Once the memo holds them, one compiled pattern of those exact bytes (`_chunk_pattern`,
`_EntryPatterns`) matches a whole record, its numbers go straight into `RawTables` columns and a
`_Row` placeholder goes on the stack. The memo entries a matched record makes are counted, not
kept: its strings are kept as ids (`hot_idx`), its chunk object as where the record is
(`chunk_idx`: rebuilt as a stub when fetched again); fetching any other one raises `Fallback`.

Frames (protocol 4: `FRAME n` then n bytes of opcodes) are walked first and removed
(`deframe`); a frame must begin where an opcode of the stream begins, as the C unpickler reads
them (else Fallback).
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from typing import Any

from hybridckpt.containers.dcp_stubs import DCP_POLICY
from hybridckpt.containers.dcp_tables import MAX_DIMS, RawTables
from hybridckpt.containers.pickle.allow import Stub, stub_class


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



class Records:
    """The record half of the machine: the memo, matched chunk and storage-entry records
    (pushed on `stack` as `_Row`s), frames. `dcp_fast._Machine` adds the opcode loop and the
    save plans' write items (`dcp_plans`)."""


    def __init__(self, buf: bytes, frames: list[int], path: str, raw: RawTables):
        self.buf, self.frames, self.fi = buf, frames, 0
        self.path, self.raw = path, raw
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.memo_n = 0
        self.hot_idx, self.hot_str = array("q"), array("i")  # memoized strings of matched records
        self.chunk_idx, self.chunk_pos = array("q"), array("q")  # matched chunks: memo index, where
        self.known: dict[str, int] = {}
        self.chunk_pattern: re.Pattern | None = None
        self.entry_patterns: _EntryPatterns | None = None
        self.item_pattern: re.Pattern | None = None  # a save plan's write item (`dcp_plans`)
        self.checked: dict[int, Any] = {}  # memo index -> the name / (class,) it was seen to hold
        self.items_good: set = set()  # write items' name / class fetch bytes seen good (`dcp_plans`)
        self.heads_matched = 0  # tensor heads matched (`dcp_heads`)
        self.heads_good: set = set()  # tensor heads' name / class fetch bytes seen good (`dcp_heads`)
        self.fetch_good: set = set()  # fetch bytes of theirs seen to name an entry that exists
        self.item_idx, self.item_pos = array("q"), array("q")  # matched write items: memo base, where
        self.items_matched = 0
        self.ops = 0  # opcodes the loop (`dcp_fast`) read one at a time
        self.plan_lists: dict[int, list] = {}  # id(list) -> a list matched write items went into
        self.lists: dict[int, list] = {}  # id(list) -> [list, first row, count]
        self.storage: dict[int, dict] = {}  # id(dict) -> the dict storage entries went into
        self.converted: dict[int, Any] = {}  # stubs turned into rows: never built again
        self.size_cache: dict = {}
        self.text_ids: dict[bytes, int] = {}
        self.ints_good: set[bytes] = set()  # storage entries' index ints seen good
        self.fetch_sid: dict[int, int] = {}  # memo index of a string -> its id in `raw.strings`
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
        k = bisect_left(self.chunk_idx, i)
        if k < len(self.chunk_idx) and self.chunk_idx[k] == i:
            return self.chunk_again(self.chunk_pos[k])
        return self.fetch_more(i)

    def fetch_more(self, i: int):
        """Memo entry `i` that none of the above holds (`dcp_fast`: a matched write item's)."""
        raise Fallback  # an entry inside a matched record, or none

    def chunk_again(self, pos: int):
        """A matched chunk record fetched again from the memo (megatron-core pickles every rank's
        save plan in `Metadata.all_local_plans`, whose write items hold the same chunk objects):
        the stub the general machine built, built again from the record's bytes at `pos`. It
        may be read, never changed (a BUILD on it falls back: the chunk's row is already taken)."""
        m = self.chunk_pattern.match(self.buf, pos)
        offs, sizes = _size_value(m, 1, self.size_cache), _size_value(m, 4, self.size_cache)
        obj = self.chunk_class.__new__(self.chunk_class)
        obj.__setstate__({"offsets": _SIZE(offs), "sizes": _SIZE(sizes)})
        self.convert(obj)
        return obj

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
        at, where, frames_in, get = self.chunk_idx.append, self.chunk_pos.append, self.frames_in, cache.get
        while True:
            m = pattern.match(buf, pos)
            if m is None:
                return pos
            G = m.groups()  # per size: its 1-3 ints, their TUPLEn, 4+ ints (`_size`)
            offs, sizes = get(G[0]), get(G[3])  # a run seen before, of the right length, is good
            if offs is None or len(offs) != _TUPLE_N[G[1][0]]:
                offs = _size_value(m, 1, cache)
            if sizes is None or len(sizes) != _TUPLE_N[G[4][0]]:
                sizes = _size_value(m, 4, cache)
            if len(offs) != len(sizes):
                raise Fallback
            at(self.memo_n)  # the record's object is memoized first
            where(pos)
            self.memo_n += 8 - (offs == ()) - (sizes == ())  # obj, dict, per size: tuple, 1-tuple, Size
            e = m.end()
            frames_in(pos, e)
            push(_Row((offs, sizes)))
            pos = e

    def entries(self, pos: int) -> int:
        """Storage entries (key then value) from `pos` on, each pushed as `_Row`, `_VALUE`."""
        t, buf, push = self.entry_patterns, self.buf, self.stack.append
        if t is None:
            return pos
        cache, ints_good = self.size_cache, self.ints_good
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
            if idx != b"N" and idx not in ints_good:
                _check(_int_run(idx))
                if len(ints_good) < 1 << 16:
                    ints_good.add(idx)
            self.memo_n += 2  # the MetadataIndex and its dict
            fqn = self.text_id(gr[0], gr[1], gr[2], gr[3])
            offs = None  # a byte item
            if gr[5] is not None:
                offs = cache.get(gr[6])
                if offs is None or len(offs) != _TUPLE_N[gr[7][0]]:
                    offs = _size_value(m, 7, cache)
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
        i = b1[0] if b1 is not None else int.from_bytes(j4, "little")
        sid = self.fetch_sid.get(i)  # memo entries are never replaced: a string's id is for good
        if sid is None:
            v = self.fetch(i)
            if type(v) is not str:
                raise Fallback
            sid = self.raw.string_id(v)
            if len(self.fetch_sid) < 1 << 20:
                self.fetch_sid[i] = sid
        return sid

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

    def convert(self, obj) -> None:
        """`obj` became rows (or was rebuilt from a record): a BUILD on it falls back."""
        self.converted[id(obj)] = obj
