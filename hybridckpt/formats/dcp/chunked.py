"""A DCP global tensor over its rows of the chunk table: chunk objects made only where read.

`lazy.Tiled` holds one block object per chunk; a tensor of a run on 1024 ranks has 1024 chunks
and a checkpoint millions, most of which one host of a multi-host import never reads.
`Chunked` keeps the tensor's rows of the `ChunkTable` (`containers.dcp_tables`: offsets, sizes,
file, byte range per chunk, numpy columns) and finds the chunks a box intersects with array
arithmetic; each such chunk becomes a `TorchSaveChunk` (its `torch.save` archive parsed on
first read) kept in a small per-tensor cache (the most recently used `CACHE` chunks), so memory
follows what this process reads, not the checkpoint. Reads and file runs are those of
`lazy.Tiled` over the intersecting chunks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from hybridckpt.containers.dcp_metadata import TensorEntry
from hybridckpt.formats.dcp.chunk import TorchSaveChunk
from hybridckpt.lazy import Box, FileRun, LazyTensor, block_overlap, tiled_file_runs

CACHE = 4096  # chunks of one tensor kept parsed (each ~1 KiB)


@dataclass(frozen=True, eq=False)
class Chunked(LazyTensor):
    """The global tensor of `entry` (a `TensorEntry`: its rows of the chunk table tile it)."""

    entry: TensorEntry
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def dtype(self) -> np.dtype:
        return self.entry.dtype

    def stored_pieces(self) -> int:
        """Chunks holding elements (what `inspect` lists as pieces)."""
        e = self.entry
        return int((e.table.sizes[e.rows].prod(axis=1) > 0).sum())

    def rows_in(self, box: Box) -> np.ndarray:
        """Table rows of the chunks holding elements of `box`, in table order."""
        e, nd = self.entry, len(self.shape)
        t = e.table
        if nd == 0:
            return np.arange(e.first, e.first + e.count)
        lo = t.offsets[e.rows, :nd]
        hi = lo + t.sizes[e.rows, :nd]
        a = np.array([s for s, _ in box], dtype=np.int64)
        b = np.array([s for _, s in box], dtype=np.int64)
        hit = ((lo < b) & (hi > a) & (hi > lo)).all(axis=1)
        return e.first + np.flatnonzero(hit)

    def block(self, row: int) -> tuple[tuple[int, ...], TorchSaveChunk]:
        """The chunk of table row `row`: its offsets and its lazy block."""
        with self._lock:
            got = self._cache.get(row)
            if got is not None:
                self._cache.move_to_end(row)
                return got
        e, nd = self.entry, len(self.shape)
        t = e.table
        offs = tuple(int(x) for x in t.offsets[row, :nd])
        sizes = tuple(int(x) for x in t.sizes[row, :nd])
        got = (offs, TorchSaveChunk(t.files[t.file[row]], int(t.start[row]), int(t.length[row]), sizes, e.dtype, e.fqn))
        with self._lock:
            self._cache[row] = got
            if len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        return got

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """Each intersecting chunk fills its own slab of `out` (no intermediate copy)."""
        if out.size == 0:
            return
        for row in self.rows_in(box).tolist():
            offs, block = self.block(row)
            sub = block_overlap(box, offs, block.shape)
            if sub is not None:
                dst = tuple(slice(o + s - a, o + e - a) for (s, e), o, (a, _) in zip(sub, offs, box, strict=True))
                block.read_into(sub, out[dst])

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        return tiled_file_runs(box, [self.block(r) for r in self.rows_in(box).tolist()], limit)
