"""DCP's own lazy tensor: a chunk saved with `torch.save` inside a `.distcp` file (the global
tensor tiled from such chunks at their offsets is `lazy.tiled`).

A `.distcp` chunk is a complete `torch.save` zip archive of the local block (shape = chunk
sizes) at bytes `[offset, offset + length)` of the file (pytorch/pytorch:
torch/distributed/checkpoint/filesystem.py); a global tensor is the blocks at the offsets the
metadata gives, which tile it exactly (checked by the caller, `containers.dcp_metadata.check_tiling`).

A run on 512 ranks holds a million chunks of a few thousand shapes, and a host whose mesh cuts
every chunk touches all of them: each archive is parsed in full only once per (length, shape,
dtype) (`_TEMPLATES`, bounded); another chunk of that kind is read at its non-element bytes
(~2 KiB: the zip's headers and directory, `data.pkl`, `byteorder`) and compared with the parsed
one's outside the ranges a load neither reads nor checks (`torch_save.unchecked_ranges`: the
elements, `.data/serialization_id`, those entries' CRCs). Equal: the same object at the same
relative offsets, so its elements are at the parsed one's offset plus the distance between the
two archives. Not equal: parsed in full (and refused, if bad, by the same checks).
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
from hybridckpt.lazy import Deferred, LazyTensor, Slice, StoredTensor

TEMPLATES = 1024  # kinds of chunk (length, shape, dtype) kept parsed, most recently used
_TEMPLATES: OrderedDict = OrderedDict()
_LOCK = threading.Lock()
COUNTS = {"parsed": 0, "matched": 0}  # full parses / chunks found equal to a parsed one (tests)


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

    def matches(self, src: ByteSource, offset: int) -> bool:
        head = np.frombuffer(src.read(offset, self.data), np.uint8)
        if not np.array_equal(head[self.keep_head], np.frombuffer(self.head, np.uint8)[self.keep_head]):
            return False
        tail = np.frombuffer(src.read(offset + self.data + self.nbytes, len(self.tail)), np.uint8)
        return bool(np.array_equal(tail[self.keep_tail], np.frombuffer(self.tail, np.uint8)[self.keep_tail]))


class _Held:
    """An archive's bytes already read, its elements left out (read back as zeros): `head` at 0,
    `tail` at `tail_at`; what `torch_save.unchecked_ranges` parses (no second read of the file)."""

    def __init__(self, head: bytes, tail: bytes, tail_at: int):
        self.head, self.tail, self.tail_at = head, tail, tail_at

    def read_into(self, offset: int, buffer: memoryview) -> None:
        buffer[:] = self.read(offset, len(buffer))

    def read(self, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        for at, part in ((0, self.head), (self.tail_at, self.tail)):
            a, b = max(offset, at), min(offset + nbytes, at + len(part))
            if a < b:
                out[a - offset : b - offset] = part[a - at : b - at]
        return bytes(out)


def _template(path: str, offset: int, length: int, t: StoredTensor) -> _Template | None:
    """The template of a chunk just parsed to `t`, or None (not one plain stored tensor)."""
    data, nbytes = t.offset - offset, int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
    if data < 0 or data + nbytes > length or length - nbytes > 1 << 20:
        return None
    src = ByteSource(path)
    head, tail = src.read(offset, data), src.read(offset + data + nbytes, length - data - nbytes)
    ranges = torch_save.unchecked_ranges(_Held(head, tail, data + nbytes), length, f"{path}@{offset}+{length}")
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
    """`t` as one stored tensor: itself, or the whole of one (a `Slice` of its full region, as
    a chunk's `torch.save` reads back); else None."""
    if type(t) is StoredTensor:
        return t
    src = getattr(t, "src", None)
    if type(t) is Slice and type(src) is StoredTensor and src.shape == tuple(t.shape) and all(
        a == 0 and b == n for (a, b), n in zip(t.region, src.shape, strict=True)
    ):
        return src
    return None


def chunk_tensor(path: str, offset: int, length: int, shape: tuple[int, ...], dtype: np.dtype,
                 fqn: str = "") -> LazyTensor:
    """The tensor of the chunk at `[offset, offset + length)` of `path`, checked against the
    metadata's `shape` and `dtype`; a chunk of a kind parsed before is matched, not parsed."""
    path = os.path.abspath(path)
    key = (length, shape, np.dtype(dtype).str)
    with _LOCK:
        tpl = _TEMPLATES.get(key)
        if tpl is not None:
            _TEMPLATES.move_to_end(key)
    src = ByteSource(path)
    if tpl is not None and offset >= 0 and offset + length <= src.size() and tpl.matches(src, offset):
        COUNTS["matched"] += 1
        return StoredTensor(src, offset + tpl.data, shape, np.dtype(dtype))
    COUNTS["parsed"] += 1
    t = torch_save.load(path, base_offset=offset, length=length)
    what = f"{path}@{offset}+{length} ('{fqn}')"
    if not isinstance(t, LazyTensor):
        raise FormatError(f"{what}: chunk holds {type(t).__name__}, not a tensor")
    if tuple(t.shape) != shape or np.dtype(t.dtype) != np.dtype(dtype):
        raise FormatError(f"{what}: chunk is {t.dtype} {t.shape}, the metadata says {dtype} {shape}")
    plain = _plain(t)
    if plain is not None:
        t = plain
    if tpl is None and plain is not None and t.source.path == path:
        tpl = _template(path, offset, length, t)
        if tpl is not None:
            with _LOCK:
                _TEMPLATES[key] = tpl
                if len(_TEMPLATES) > TEMPLATES:
                    _TEMPLATES.popitem(last=False)
    return t


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
        if t is None:  # two threads may both parse it: harmless, same result
            t = chunk_tensor(self.path, self.offset, self.length, self.shape, self.dtype, self.fqn)
            self._cache["t"] = t
        return t
