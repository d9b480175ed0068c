"""Raw zarr v2 chunks written as plain files, without TensorStore: the data path of a raw import.

An Orbax item saved without OCDBT (`PyTreeCheckpointHandler(use_ocdbt=False)`) keeps each array as
a zarr v2 array in its own folder, `<item>/<array name>/`: the `.zarray` metadata and one file per
chunk, named by its grid position joined with the `dimension_separator` (`"."`; `"0"` for a 0-d
array), each holding the whole chunk (edge chunks padded with zeros, the fill value of
`fill_value: null`). With `compressor: null`, no filters and `order: "C"` a chunk file is exactly
the chunk's C-order little-endian bytes (zarr v2 spec, "Chunk storage"; TensorStore's
`zarr` driver, google/tensorstore:tensorstore/driver/zarr/driver.cc, reads and writes the same
files), so a tile read by an import is written with one `write` per chunk, from the tile's own
buffer where the chunk is a contiguous part of it, and fsync'd before Orbax commits the item.

Against TensorStore's write path (OCDBT: an encode copy into a fresh buffer per chunk, a B-tree
commit and fsync per tile, its own thread pool), this is one copy into the page cache per byte;
`benchmarks/orbax_speed.py` rows (f) measure the difference. Plain `orbax.checkpoint` restores
the result (its `_METADATA` says `use_ocdbt: false`), and `store.chunk_index` finds these chunks
by listing the folder instead of walking an OCDBT index.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np

from hybridckpt.io.writeback import fsync_folder
from hybridckpt.lazy import Box


@dataclass(frozen=True)
class ChunkFiles:
    """Where the raw chunks of one array go: `folder` (`<item>/<array name>`), the zarr key
    separator, and the chunk shape (elements per axis)."""

    folder: str
    separator: str
    chunk: tuple[int, ...]

    def key(self, origin: tuple[int, ...]) -> str:
        """The file name of the chunk whose first element is at `origin` (on the grid)."""
        return self.separator.join(str(o // c) for o, c in zip(origin, self.chunk, strict=True)) or "0"

    def path(self, origin: tuple[int, ...]) -> str:
        return os.path.join(self.folder, self.key(origin))


def target_of(spec_json: dict, chunk: tuple[int, ...]) -> ChunkFiles | None:
    """The `ChunkFiles` of an Orbax write spec whose chunks are raw bytes in plain files (zarr v2,
    no compressor or filters, C order, a `file` kvstore, no dtype cast), else None: TensorStore
    then writes them (compressed chunks, OCDBT, zarr v3)."""
    meta = spec_json.get("metadata") or {}
    kv = spec_json.get("kvstore") or {}
    if (spec_json.get("driver") != "zarr" or kv.get("driver") != "file" or not kv.get("path")
            or meta.get("compressor") is not None or meta.get("filters") or meta.get("order", "C") != "C"
            or str(meta.get("dtype", "<")).startswith(">")):
        return None
    return ChunkFiles(os.fspath(kv["path"]), meta.get("dimension_separator", "."), tuple(int(c) for c in chunk))


def write_tile(target: ChunkFiles, box: Box, data: np.ndarray) -> int:
    """Write every chunk of the tile `data` at `box` (whole chunks of the grid, clipped at the
    array's edge) to its file and fsync it; returns the bytes written."""
    written = 0
    steps = [range(a, b, c) for (a, b), c in zip(box, target.chunk, strict=True)]
    for origin in itertools.product(*steps):
        sub = tuple(slice(o - a, min(o + c, b) - a) for o, c, (a, b) in zip(origin, target.chunk, box, strict=True))
        piece = data[sub]
        if piece.shape != target.chunk:  # an edge chunk: zarr v2 stores it whole, padded
            full = np.zeros(target.chunk, dtype=data.dtype)
            full[tuple(slice(0, n) for n in piece.shape)] = piece
            piece = full
        written += _write_file(target.path(origin), np.ascontiguousarray(piece))
    return written


def _write_file(path: str, data: np.ndarray) -> int:
    """`data`'s bytes as the whole file `path` (created or truncated), fsync'd."""
    view = memoryview(data.reshape(-1).view(np.uint8))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(view)


def sync_folder(folder: str) -> None:
    """fsync an array's folder, so the names of the chunk files written into it are durable too."""
    fsync_folder(folder)
