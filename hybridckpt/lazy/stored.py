"""The leaves of every view: an in-memory array (`ArrayTensor`) and bytes in a file (`StoredTensor`).

`StoredTensor` is C-contiguous little-endian elements of `dtype` at a byte offset of a
`ByteSource`; a box that is one run is read with one pread straight into the caller's buffer when
it is C-contiguous and of the stored dtype; a transposing read (`out` contiguous along another
axis than the file's rows) of one run or of runs a page or more apart is read strip by strip
straight into the staging rows of its transposing copy (`_rows_into`); any other box is read by
slabs (`ByteSource.read_span` where its runs lie close together) and copied by one strided,
transposing or casting copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hybridckpt.io.byte_source import ByteSource
from hybridckpt.lazy import element_copy
from hybridckpt.lazy.base import FileRun, LazyTensor, copy_into
from hybridckpt.lazy.box import Box, box_runs, box_shape, flat_ranges


@dataclass(frozen=True, eq=False)
class ArrayTensor(LazyTensor):
    """An in-memory array seen as a lazy tensor."""

    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def read_box(self, box: Box) -> np.ndarray:
        return np.ascontiguousarray(self.array[tuple(slice(a, b) for a, b in box)])

    def read_into(self, box: Box, out: np.ndarray) -> None:
        copy_into(out, self.array[tuple(slice(a, b) for a, b in box)])


@dataclass(frozen=True, eq=False)
class StoredTensor(LazyTensor):
    """C-contiguous little-endian elements at byte `offset` of a file; `shape`, `dtype` as stored."""

    source: ByteSource
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    # read_box: the protocol's (an array of the box's shape, filled by read_into)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """One run into a C-contiguous `out` of the stored dtype: one pread, no copy. A
        transposed `out` of one run or runs a page apart: strip by strip into the staging rows of
        its transposing copy (`_rows_into`). Anything
        else (many runs, a cast `out`) is read in slabs of at most SPAN_BYTES:
        runs less than a page apart (so the span touches no page the runs do not) as one pread
        of their span, then one strided (transposing, casting) copy out of it; runs further
        apart (`ByteSource.read_runs`: one preadv per batch of runs at most 8 KiB apart, else a
        pread a run) straight into a C-contiguous `out` of the stored dtype, else into a packed
        buffer, then one copy. A `[1024, 2816]`-row tp shard of a
        row-parallel fp32 weight read into a transposed tile is thousands of runs: one pread and
        one numpy copy instead of a pread per row."""
        if out.size == 0:
            return
        starts, run_len = box_runs(self.shape, box)
        item = np.dtype(self.dtype).itemsize
        if len(starts) == 1 and out.dtype == np.dtype(self.dtype):
            if out.flags.c_contiguous:
                self.source.read_into(self.offset + int(starts[0]) * item, memoryview(out.reshape(-1).view(np.uint8)))
                return
            rows = row_views(out, SCATTER_ROW_BYTES)
            if rows is not None:  # one run of the file into the rows of a strided `out`: no copy
                self.source.read_scatter(self.offset + int(starts[0]) * item, rows)
                return
        if self._rows_into(box, out):
            return
        for slab in _slabs(self.shape, box, SPAN_BYTES // item):
            where = tuple(slice(a - a0, b - a0) for (a, b), (a0, _) in zip(slab, box, strict=True))
            self._slab_into(slab, out[where])

    def _rows_into(self, box: Box, out: np.ndarray) -> bool:
        """A transposing read (`out` contiguous along another axis than the file's rows: the
        `[in, out]` tile of a torch `[out, in]` weight) whose rows are one run or runs at least a
        page apart, read strip by strip straight into the padded staging rows of the transposing
        copy (`element_copy.transposed_rows`): one run by `read_scatter` (its rows the staging
        rows), runs apart by `read_runs` (one preadv a strip, the gaps into scratch). Before, the
        whole slab was read into a fresh buffer (every page faulted in and zeroed by the kernel:
        huge pages, numpy advises them for large arrays) and copied into the staging rows again
        (`memmove`) before the transposing copy. False (nothing read) where the box is not such
        a read: no transposition, rows under SCATTER_ROW_BYTES, runs closer than a page (one
        pread of their span, `_slab_into`), too many other slices."""
        if out.ndim < 2 or element_copy.too_small(out):
            return False
        item = np.dtype(self.dtype).itemsize
        wide = [d for d, (lo, hi) in enumerate(box) if hi - lo > 1]
        b = wide[-1]  # the file's fastest axis in the box: its rows along b
        a = element_copy.fastest_axis(out)
        if a == b or math.prod(self.shape[b + 1:]) != 1 or box_shape(box)[b] * item < SCATTER_ROW_BYTES:
            return False
        if math.prod(n for d, n in enumerate(box_shape(box)) if d not in (a, b)) > element_copy.STAGED_MAX_OUTER:
            return False
        strides = _strides(self.shape, item)  # bytes
        row = box_shape(box)[b] * item
        if strides[a] != row and strides[a] - row < PAGE_BYTES:
            return False  # runs close together: one pread of their span (`_slab_into`)
        first = self.offset + sum(lo * s for (lo, _), s in zip(box, strides, strict=True))
        others = [d for d in range(len(box)) if d not in (a, b)]
        views: dict[tuple[int, int], list[memoryview]] = {}  # (address, rows) -> the staging rows' views

        def fill(rest: tuple[int, ...], i: int, rows: np.ndarray) -> None:
            at = first + i * strides[a] + sum(r * strides[d] for d, r in zip(others, rest, strict=True))
            if strides[a] == row:  # the strip's rows lie side by side in the file: one run
                # every strip fills the same staging rows (`element_copy.stage_rows`): their
                # views made once a box, not a Python memoryview a row a strip
                key = (rows.ctypes.data, len(rows))
                if key not in views:
                    views[key] = row_views(rows)
                self.source.read_scatter(at, views[key])
            else:
                span, step = _strided_span(rows)
                self.source.read_runs(at + np.arange(len(rows), dtype=np.int64) * strides[a], row, span, step)

        element_copy.transposed_rows(out, self.dtype, a, b, fill)
        return True

    def _slab_into(self, box: Box, out: np.ndarray) -> None:
        starts, run_len = box_runs(self.shape, box)
        item = np.dtype(self.dtype).itemsize
        first, span = int(starts[0]), int(starts[-1]) + run_len - int(starts[0])
        gap = (span - len(starts) * run_len) // max(1, len(starts) - 1) * item
        if len(starts) == 1 or gap < PAGE_BYTES:
            buf = self.source.read_span(self.offset + first * item, span * item, (starts - first) * item, run_len * item)
            view = np.ndarray(box_shape(box), self.dtype, buffer=buf, offset=0, strides=_strides(self.shape, item))
            copy_into(out, view)
            return
        # runs far apart: batched preadvs, packed in the box's C order, so straight into `out`
        # where it is C-contiguous of the stored dtype (the rows' strips of an untransposed
        # tile), else into a packed buffer copied (transposed, cast) into `out` once
        direct = out.flags.c_contiguous and out.dtype == np.dtype(self.dtype)
        tmp = out if direct else np.empty(box_shape(box), dtype=self.dtype)
        offsets = self.offset + starts.astype(np.int64) * item
        self.source.read_runs(offsets, run_len * item, memoryview(tmp.reshape(-1).view(np.uint8)))
        if not direct:
            copy_into(out, tmp)

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        ranges = flat_ranges(self.shape, box, limit)
        if ranges is None:
            return None
        item = np.dtype(self.dtype).itemsize
        return [FileRun(self.source, self.offset + a * item, (b - a) * item) for a, b in ranges]

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        item = out.dtype.itemsize
        self.source.read_into(self.offset + start * item, memoryview(out.view(np.uint8)))
        return out


def row_bytes(out: np.ndarray) -> tuple[int, int]:
    """(k, bytes): `out`'s C-contiguous rows are its axes from k on, `bytes` long; k is -1 where
    `out` has another layout (negative or zero strides)."""
    k, step = out.ndim, out.dtype.itemsize
    while k > 0 and (out.shape[k - 1] == 1 or out.strides[k - 1] == step):
        step *= out.shape[k - 1]
        k -= 1
    bad = any(s <= 0 for s, n in zip(out.strides[:k], out.shape[:k], strict=True) if n > 1)
    return (-1 if bad else k), step


def row_views(out: np.ndarray, min_bytes: int = 1) -> list[memoryview] | None:
    """`out`'s elements in C order as byte views of its C-contiguous rows (`row_bytes`), or None
    where such a row is under `min_bytes` or `out` has another layout. Views are slices of one
    memoryview of the array `out` is a view of (no numpy call a row)."""
    k, step = row_bytes(out)
    if k < 0 or step < min_bytes:
        return None
    root = out
    while isinstance(root.base, np.ndarray):
        root = root.base
    if k == 0 or not root.flags.c_contiguous:
        return [memoryview(out[idx].reshape(-1).view(np.uint8)) for idx in np.ndindex(*out.shape[:k])]
    whole = memoryview(root.reshape(-1).view(np.uint8))
    offsets = np.array([out.ctypes.data - root.ctypes.data], dtype=np.int64)
    for n, s in zip(out.shape[:k], out.strides[:k], strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return [whole[o: o + step] for o in offsets.tolist()]


def _strided_span(rows: np.ndarray) -> tuple[memoryview, int]:
    """(bytes, step) of a 2-D `rows` whose rows are C-contiguous: one byte view of the memory
    from its first row's start to its last row's end, and the bytes from row to row."""
    root = rows
    while isinstance(root.base, np.ndarray):
        root = root.base
    whole = memoryview(root.reshape(-1).view(np.uint8))
    start, step = rows.ctypes.data - root.ctypes.data, rows.strides[0]
    return whole[start: start + (len(rows) - 1) * step + rows.shape[1] * rows.itemsize], step


SCATTER_ROW_BYTES = 512  # rows shorter than this are read in slabs and copied (a preadv view each costs)
SPAN_BYTES = 8 << 20  # most bytes of a file one read of many runs preads at once (a slab's buffer)
PAGE_BYTES = 4096  # runs less than a page apart are read as one span (it touches only their pages)


def _strides(shape: tuple[int, ...], item: int) -> tuple[int, ...]:
    """C-order byte strides of `shape`."""
    out, step = [], item
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _slabs(shape: tuple[int, ...], box: Box, limit: int) -> list[Box]:
    """`box` cut along its leading axes into sub-boxes whose C-order span inside `shape` is at most
    `limit` elements (as few cuts as that allows; a single element is never cut)."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    span = sum((b - a - 1) * s for (a, b), s in zip(box, strides, strict=True)) + 1
    ax = next((i for i, (a, b) in enumerate(box) if b - a > 1), None)
    if span <= limit or ax is None:
        return [box]
    rest = span - (box[ax][1] - box[ax][0] - 1) * strides[ax]  # the span of one index along ax
    step = max(1, (limit - rest) // strides[ax] + 1) if rest <= limit else 1
    out = []
    for s in range(box[ax][0], box[ax][1], step):
        sub = list(box)
        sub[ax] = (s, min(box[ax][1], s + step))
        sub_t = tuple(sub)
        out.extend([sub_t] if rest <= limit else _slabs(shape, sub_t, limit))
    return out
