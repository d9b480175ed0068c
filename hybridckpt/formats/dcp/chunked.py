"""A DCP global tensor over its rows of the chunk table: chunk objects made only where read.

`lazy.Tiled` holds one block object per chunk; a tensor of a run on 1024 ranks has 1024 chunks
and a checkpoint millions, most of which one host of a multi-host import never reads.
`Chunked` keeps the tensor's rows of the `ChunkTable` (`containers.dcp_tables`: offsets, sizes,
file, byte range per chunk, numpy columns) and finds the chunks a box intersects with array
arithmetic; each such chunk is found once (`chunk.chunk_tensor`: its `torch.save` archive parsed,
or matched against a parsed one of its kind) and only where its elements start is kept (8 bytes
a chunk; a chunk that is not one plain stored tensor stays whole in a small cache, the most
recently used `CACHE`), so memory does not grow with the chunks a plan touches. Reads and file runs are those of
`lazy.Tiled` over the intersecting chunks.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from hybridckpt.containers.dcp_metadata import TensorEntry
from hybridckpt.formats.dcp.chunk import chunk_tensor
from hybridckpt.io.byte_source import ByteSource, real_reads
from hybridckpt.lazy import Box, FileRun, LazyTensor, StoredTensor, block_overlap, tiled_file_runs

CACHE = 64  # chunks of one tensor kept whole when they are not plain stored tensors


@dataclass(frozen=True, eq=False)
class Chunked(LazyTensor):
    """The global tensor of `entry` (a `TensorEntry`: its rows of the chunk table tile it)."""

    entry: TensorEntry
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _at: dict = field(default_factory=dict, repr=False)  # "at": int64 per row, where its elements start (-1)
    _finding: dict = field(default_factory=dict, repr=False)  # row -> Event: being found by one thread

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

    def block(self, row: int) -> tuple[tuple[int, ...], LazyTensor]:
        """The chunk of table row `row`: its offsets and its tensor (found on first use, by real
        reads even while a plan is made: the plan counts them, as the import reads them; by
        one thread, the others asking for it meanwhile wait, so each chunk is found once)."""
        e, nd = self.entry, len(self.shape)
        t = e.table
        offs = tuple(int(x) for x in t.offsets[row, :nd])
        sizes = tuple(int(x) for x in t.sizes[row, :nd])
        path = t.files[t.file[row]]
        while True:
            with self._lock:
                at = self._at.get("at")
                if at is None:
                    at = self._at["at"] = np.full(e.count, -1, dtype=np.int64)
                where = int(at[row - e.first])
                got = self._cache.get(row) if where < 0 else None
                if got is not None:
                    self._cache.move_to_end(row)
                    return got
                busy = self._finding.get(row) if where < 0 else None
                if busy is None:
                    if where < 0:  # this thread finds it; another asking meanwhile waits for it
                        mine = self._finding[row] = threading.Event()
                    break
            busy.wait()  # (then found: at its offset, or in the cache)
        if where >= 0:
            return offs, StoredTensor(ByteSource(os.path.abspath(path)), where, sizes, e.dtype)
        try:
            with real_reads():
                found = chunk_tensor(path, int(t.start[row]), int(t.length[row]), sizes, e.dtype, e.fqn)
            with self._lock:
                if type(found) is StoredTensor:
                    at[row - e.first] = found.offset
                else:
                    self._cache[row] = (offs, found)
                    if len(self._cache) > CACHE:
                        self._cache.popitem(last=False)
        finally:
            with self._lock:
                del self._finding[row]
            mine.set()
        return offs, found

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
