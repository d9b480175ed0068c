"""A global tensor tiled from blocks at their global offsets: DCP chunks, FlexCheckpoint blocks,
Megatron optimizer pieces, the chunks of our own store. A box reads only the blocks it
intersects, each only the overlap (the blocks tiling the tensor exactly is checked by whoever
builds it, e.g. `containers.dcp_metadata.check_tiling`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridckpt.lazy.base import FileRun, LazyTensor
from hybridckpt.lazy.box import Box, block_overlap
from hybridckpt.lazy.runs import tiled_file_runs


@dataclass(frozen=True, eq=False)
class Tiled(LazyTensor):
    """A global tensor made of blocks: `pieces` are `(offsets, block)` that tile `shape` exactly
    (checked by the caller). A box reads only the blocks it intersects, each only the overlap."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[tuple[tuple[int, ...], LazyTensor], ...]

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """Each intersecting block fills its own slab of `out` (no intermediate copy)."""
        if out.size == 0:
            return
        for offs, block in self.pieces:
            sub = block_overlap(box, offs, block.shape)
            if sub is not None:
                dst = tuple(slice(o + s - a, o + e - a) for (s, e), o, (a, _) in zip(sub, offs, box, strict=True))
                block.read_into(sub, out[dst])

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        return tiled_file_runs(box, self.pieces, limit)


def tiled(entry_shape: tuple[int, ...], dtype, pieces) -> LazyTensor:
    """`Tiled`, or the single block itself when one block is the whole tensor."""
    pieces = tuple((tuple(o), b) for o, b in pieces)
    if len(pieces) == 1 and pieces[0][1].shape == tuple(entry_shape):
        return pieces[0][1]
    return Tiled(tuple(entry_shape), np.dtype(dtype), pieces)
