"""DCP's own lazy tensor: a chunk saved with `torch.save` inside a `.distcp` file (the global
tensor tiled from such chunks at their offsets is `lazy.tiled`).

A `.distcp` chunk is a complete `torch.save` zip archive of the local block (shape = chunk
sizes) at bytes `[offset, offset + length)` of the file (pytorch/pytorch:
torch/distributed/checkpoint/filesystem.py); a global tensor is the blocks at the offsets the
metadata gives, which tile it exactly (checked by the caller, `containers.dcp_metadata.check_tiling`).

A run on 512 ranks holds a million chunks of a few thousand shapes, and a host whose mesh cuts
every chunk touches all of them. A plain chunk (one stored tensor of `nbytes = prod(shape) *
itemsize` element bytes, as DCP writes) has `rest = length - nbytes` other bytes (~1.5 KiB: the
zip's headers and directory, `data.pkl`, `byteorder`, `.data/serialization_id`), all of them in
its first `rest` bytes and its last `rest` bytes (wherever the elements lie, they cover the middle).
So every chunk is read the same way, whatever was read before: those two ends (one read of the
whole chunk when they meet; at most `2 * rest` bytes), then
- of a kind (length, shape, dtype) parsed before (`_TEMPLATES`, bounded): compared with the parsed
  one's bytes outside the ranges a load neither reads nor checks (`torch_save.unchecked_ranges`:
  the elements, `.data/serialization_id`, those entries' CRCs); equal: the same object at the same
  relative offsets, its elements at the parsed one's offset;
- else (or not equal): parsed from those bytes (`torch_save.load_source`, no further read), and
  refused, if bad, by the same checks as a parse of the file.
A chunk whose parse reaches into its middle, or whose tensor is not one plain stored tensor, is
parsed again from the file. The reads a chunk costs are a function of its own bytes only, so a
read plan (`jobs.plan_report`) counts exactly the reads the import makes, in any order, on any
number of threads.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.lazy import Deferred, LazyTensor, Reshape, Slice, StoredTensor

TEMPLATES = 1024  # kinds of chunk (length, shape, dtype) kept parsed, most recently used
ENDS_BYTES = 1 << 20  # a chunk with more non-element bytes than this is parsed from the file
_TEMPLATES: OrderedDict = OrderedDict()
_LOCK = threading.Lock()
COUNTS = {"parsed": 0, "matched": 0}  # parses (of the ends or the file) / chunks matched (tests)


class _Unheld(Exception):
    """A parse of a chunk's ends read a byte between them (not the plain layout)."""


class _Ends:
    """A chunk's first and last `rest` bytes (`parts`: (start, bytes), relative to the chunk),
    read from `src` at `offset`: one read when they meet; what a parse of the chunk reads from."""

    def __init__(self, src: ByteSource, offset: int, length: int, rest: int):
        if 2 * rest >= length:
            self.parts = ((0, src.read(offset, length)),)
        else:
            self.parts = ((0, src.read(offset, rest)), (length - rest, src.read(offset + length - rest, rest)))

    def read(self, offset: int, nbytes: int) -> bytes:
        for at, part in self.parts:
            if at <= offset and offset + nbytes <= at + len(part):
                return part[offset - at : offset - at + nbytes]
        raise _Unheld(offset, nbytes)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        buffer[:] = self.read(offset, len(buffer))


@dataclass(frozen=True)
class _Template:
    """A parsed chunk archive of one kind: its bytes outside the element range, the element
    range `[data, data + nbytes)` (relative), and the ranges not compared (`unchecked`)."""

    data: int
    nbytes: int
    head: bytes  # bytes [0, data)
    tail: bytes  # bytes [data + nbytes, length)
    keep_head: np.ndarray  # bool per byte of head: compared
    keep_tail: np.ndarray

    def matches(self, ends: _Ends) -> bool:
        """Whether the chunk whose ends are `ends` equals this one where a load reads."""
        head = np.frombuffer(ends.read(0, self.data), np.uint8)
        tail = np.frombuffer(ends.read(self.data + self.nbytes, len(self.tail)), np.uint8)
        return bool(
            np.array_equal(head[self.keep_head], np.frombuffer(self.head, np.uint8)[self.keep_head])
            and np.array_equal(tail[self.keep_tail], np.frombuffer(self.tail, np.uint8)[self.keep_tail])
        )


def _template(ends: _Ends, length: int, data: int, nbytes: int, name: str) -> _Template | None:
    """The template of a chunk just parsed from `ends` (elements at `[data, data + nbytes)`),
    or None (not the plain layout)."""
    head, tail = ends.read(0, data), ends.read(data + nbytes, length - data - nbytes)
    try:
        ranges = torch_save.unchecked_ranges(ends, length, name)
    except _Unheld:
        return None
    if ranges is None:
        return None
    keep = np.ones(length - nbytes, dtype=bool)  # the archive less its elements
    for a, b in ranges:
        a, b = max(a, 0), min(b, length)
        if b <= data or a >= data + nbytes:
            keep[a if a < data else a - nbytes : b if b <= data else b - nbytes] = False
        elif a < data or b > data + nbytes:  # a range across the elements' edge: not the plain layout
            return None
    return _Template(data, nbytes, head, tail, keep[:data].copy(), keep[data:].copy())


def _plain(t: LazyTensor) -> StoredTensor | None:
    """`t` as one stored tensor: itself, or the whole of one under any number of whole-region
    `Slice`s and C-order `Reshape`s (as a chunk's `torch.save` reads back: a `[1, 16, 32]`
    expert block is the reshape of a `[16, 32]` storage); else None."""
    shape = tuple(t.shape)
    while True:
        if type(t) is StoredTensor:
            return t if tuple(t.shape) == shape else StoredTensor(t.source, t.offset, shape, t.dtype)
        src = getattr(t, "src", None)
        if not isinstance(src, LazyTensor) or np.dtype(src.dtype) != np.dtype(t.dtype):
            return None
        if type(t) is Reshape or (type(t) is Slice and src.shape == tuple(t.shape) and all(
            a == 0 and b == n for (a, b), n in zip(t.region, src.shape, strict=True)
        )):
            t = src
        else:
            return None


def _checked(t: object, what: str, shape: tuple[int, ...], dtype: np.dtype) -> LazyTensor:
    if not isinstance(t, LazyTensor):
        raise FormatError(f"{what}: chunk holds {type(t).__name__}, not a tensor")
    if tuple(t.shape) != shape or np.dtype(t.dtype) != np.dtype(dtype):
        raise FormatError(f"{what}: chunk is {t.dtype} {t.shape}, the metadata says {dtype} {shape}")
    return t


def chunk_tensor(path: str, offset: int, length: int, shape: tuple[int, ...], dtype: np.dtype,
                 fqn: str = "") -> LazyTensor:
    """The tensor of the chunk at `[offset, offset + length)` of `path`, checked against the
    metadata's `shape` and `dtype`: read at its two ends, then matched against a parsed chunk of
    its kind or parsed from those bytes (module docstring)."""
    path = os.path.abspath(path)
    dtype = np.dtype(dtype)
    src = ByteSource(path)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    rest, size = length - nbytes, src.size()
    name = path if (offset, length) == (0, size) else f"{path}@{offset}+{length}"
    what = f"{name} ('{fqn}')"
    if 0 < rest <= ENDS_BYTES and offset >= 0 and offset + length <= size:
        ends, key = _Ends(src, offset, length, rest), (length, shape, dtype.str)
        with _LOCK:
            tpl = _TEMPLATES.get(key)
            if tpl is not None:
                _TEMPLATES.move_to_end(key)
        if tpl is not None and tpl.matches(ends):
            COUNTS["matched"] += 1
            return StoredTensor(src, offset + tpl.data, shape, dtype)
        COUNTS["parsed"] += 1
        try:
            plain = _plain(_checked(torch_save.load_source(ends, 0, length, name), what, shape, dtype))
        except _Unheld:
            plain = None
        if plain is not None and plain.source is ends:
            if tpl is None:
                tpl = _template(ends, length, plain.offset, nbytes, name)
                if tpl is not None:
                    with _LOCK:
                        _TEMPLATES[key] = tpl
                        if len(_TEMPLATES) > TEMPLATES:
                            _TEMPLATES.popitem(last=False)
            return StoredTensor(src, offset + plain.offset, shape, dtype)
    COUNTS["parsed"] += 1
    t = _checked(torch_save.load(path, base_offset=offset, length=length), what, shape, dtype)
    plain = _plain(t)
    return t if plain is None else plain


@dataclass(frozen=True, eq=False)
class TorchSaveChunk(Deferred):
    """A block saved with `torch.save` at `[offset, offset + length)` of `path`.

    The archive is parsed (or matched against one of its kind) on the first read, not at open
    time, then only the bytes of each box are read. `shape`, `dtype` as the metadata says; the
    archive must agree."""

    path: str
    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: np.dtype
    fqn: str = ""
    _cache: dict = field(default_factory=dict, repr=False)  # the parsed archive, once

    def tensor(self) -> LazyTensor:
        t = self._cache.get("t")
        if t is None:  # parsed by the first thread to ask; the others wait for it (its ends read once)
            with self._cache.setdefault("lock", threading.Lock()):
                t = self._cache.get("t")
                if t is None:
                    t = chunk_tensor(self.path, self.offset, self.length, self.shape, self.dtype, self.fqn)
                    self._cache["t"] = t
        return t
