"""The leaves of every view: an in-memory array (`ArrayTensor`) and bytes in a file (`StoredTensor`).

`StoredTensor` is C-contiguous little-endian elements of `dtype` at a byte offset of a
`ByteSource`; a box is read with one pread per run of touching rows, straight into the caller's
buffer when it is C-contiguous and of the stored dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridckpt.io.byte_source import MAX_IOVECS, PAGE_BYTES, ByteSource
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

    def read_box(self, box: Box) -> np.ndarray:
        out = np.empty(box_shape(box), dtype=self.dtype)
        self._pread_into(box, out)
        return out

    def read_into(self, box: Box, out: np.ndarray) -> None:
        if out.flags.c_contiguous and out.dtype == np.dtype(self.dtype):
            self._pread_into(box, out)
        else:
            copy_into(out, self.read_box(box))

    def _pread_into(self, box: Box, out: np.ndarray) -> None:
        """Fill the C-contiguous `out` with one pread per run of touching rows; runs separated
        by gaps shorter than a page share one `preadv` (`ByteSource.read_runs_into`: e.g. the
        2.8 KiB half-rows of a row-parallel weight split two ways, 164k preads -> 330 for a 1 GiB
        Meta import, each pread one GIL hand-off among the reader threads)."""
        if out.size == 0:
            return
        starts, run_len = box_runs(self.shape, box)
        item = out.dtype.itemsize
        view = memoryview(out.reshape(-1).view(np.uint8))
        nbytes = run_len * item
        runs = []  # (file offset, length): runs that touch merged
        i, n = 0, len(starts)
        while i < n:
            j = i + 1
            while j < n and starts[j] == starts[j - 1] + run_len:
                j += 1
            runs.append((self.offset + int(starts[i]) * item, (j - i) * nbytes))
            i = j
        pos = 0
        k = 0
        while k < len(runs):
            group = [runs[k]]
            while (k + len(group) < len(runs) and 2 * len(group) < MAX_IOVECS
                   and runs[k + len(group)][0] - (group[-1][0] + group[-1][1]) < PAGE_BYTES):  # the gap
                group.append(runs[k + len(group)])
            pieces = []
            for (at, length), nxt in zip(group, [*group[1:], None], strict=True):
                pieces.append((view[pos : pos + length], 0 if nxt is None else nxt[0] - at - length))
                pos += length
            if len(pieces) == 1:
                self.source.read_into(group[0][0], pieces[0][0])
            else:
                self.source.read_runs_into(group[0][0], pieces)
            k += len(group)

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
