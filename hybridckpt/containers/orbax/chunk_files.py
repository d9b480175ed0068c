"""Raw zarr v2 chunks written as plain files, without TensorStore: the data path of a raw import.

An Orbax item saved without OCDBT (`PyTreeCheckpointHandler(use_ocdbt=False)`) keeps each array as
a zarr v2 array in its own folder, `<item>/<array name>/`: the `.zarray` metadata and one file per
chunk, named by its grid position joined with the `dimension_separator` (`"."`; `"0"` for a 0-d
array), each holding the whole chunk (edge chunks padded with zeros, the fill value of
`fill_value: null`). With `compressor: null`, no filters and `order: "C"` a chunk file is exactly
the chunk's C-order little-endian bytes (zarr v2 spec, "Chunk storage"; TensorStore's
`zarr` driver, google/tensorstore:tensorstore/driver/zarr/driver.cc, reads and writes the same
files), so a tile read by an import is written with one `write` per chunk, from the tile's own
buffer where the chunk is a contiguous part of it (else from one aligned copy: a strip of the
tile, an edge chunk), and made durable before Orbax commits the item: each file fsync'd as it
is written, or (`ChunkFiles.sync` False) by one `syncfs` of the filesystem once the item's
chunks are all written (`io.writeback.FilesystemSync`, `store.stream_orbax`).

Direct I/O (`ChunkFiles.direct`, on unless `--buffered-writes`): a chunk of whole 4 KiB blocks
from a 4 KiB-aligned buffer (every tile buffer an import reads into) is written with `O_DIRECT`
(`io.direct_io`: why, and the fallback where a filesystem refuses it), from the tile's memory to
the device, with no copy into the page cache. Anything else (a small chunk, an unaligned piece) is
written buffered. The fsync (or the item's syncfs) follows either way.

Against TensorStore's write path (OCDBT: an encode copy into a fresh buffer per chunk, a B-tree
commit and fsync per tile, its own thread pool), this is one copy into the page cache per byte;
`benchmarks/orbax_speed.py` rows (f) measure the difference. Plain `orbax.checkpoint` restores
the result (its `_METADATA` says `use_ocdbt: false`), and `containers.orbax.chunk_index` finds these chunks
by listing the folder instead of walking an OCDBT index.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from hybridckpt.io import sequential_file, timing
from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.io.direct_io import DIRECT_ALIGN, aligned_empty, open_direct, refused
from hybridckpt.lazy import Box, box_slices, grid_boxes


@dataclass(frozen=True)
class ChunkFiles:
    """Where the raw chunks of one array go: `folder` (`<item>/<array name>`), the zarr key
    separator, the chunk shape (elements per axis), and whether whole-block chunks are written
    with O_DIRECT (see the module doc); `sync`: each file fsync'd as it is written (False: the
    caller makes them durable together, `io.writeback.FilesystemSync`, before the commit)."""

    folder: str
    separator: str
    chunk: tuple[int, ...]
    direct: bool = True
    sync: bool = True

    def key(self, origin: tuple[int, ...]) -> str:
        """The file name of the chunk whose first element is at `origin` (on the grid)."""
        return self.separator.join(str(o // c) for o, c in zip(origin, self.chunk, strict=True)) or "0"

    def path(self, origin: tuple[int, ...]) -> str:
        return os.path.join(self.folder, self.key(origin))


def target_of(spec_json: dict, chunk: tuple[int, ...], direct: bool = True) -> ChunkFiles | None:
    """The `ChunkFiles` of an Orbax write spec whose chunks are raw bytes in plain files (zarr v2,
    no compressor or filters, C order, a `file` kvstore, no dtype cast), else None: TensorStore
    then writes them (compressed chunks, OCDBT, zarr v3)."""
    meta = spec_json.get("metadata") or {}
    kv = spec_json.get("kvstore") or {}
    if (spec_json.get("driver") != "zarr" or kv.get("driver") != "file" or not kv.get("path")
            or meta.get("compressor") is not None or meta.get("filters") or meta.get("order", "C") != "C"
            or str(meta.get("dtype", "<")).startswith(">")):
        return None
    return ChunkFiles(
        os.fspath(kv["path"]), meta.get("dimension_separator", "."), tuple(int(c) for c in chunk), direct
    )


def write_tile(target: ChunkFiles, box: Box, data: np.ndarray,
               on_chunk: Callable[[Box, np.ndarray], None] | None = None,
               buffers: AlignedPool | None = None) -> int:
    """Write every chunk of the tile `data` at `box` (whole chunks of the grid, clipped at the
    array's edge) to its file, fsync'd where `target.sync`; returns the bytes written.

    on_chunk(chunk box, elements): called for each chunk before its file is written, with its
    stored elements (unpadded) as the C-contiguous array the file is written from where the
    chunk is whole (`_chunk_bytes`: the tile's own rows, or the one copy of a strip), else as a
    view of the tile (an edge chunk). The import checksums each chunk there
    (`store.stream_orbax`): a strip of the tile is then copied once, for the file, and
    checksummed from that copy, where a checksum of the tile copied it out a first time (two
    strided copies of every strip byte: the fsdp-cut `[vocab, embed]` and `[ffn, hidden]` rows
    of an FSDP2 import, 0.3 GB of a 1.6 GB import).

    buffers: where a chunk must be copied out of the tile, its aligned buffer is lent by this
    pool (`io.aligned_pool`) and given back once the file is written, instead of made fresh."""
    written = 0
    for sub in grid_boxes(box, target.chunk):
        view = data[box_slices(sub, box)]
        whole = view.shape == target.chunk and view.flags.c_contiguous
        with nullcontext() if whole or buffers is None else buffers.lend(target.chunk, view.dtype) as spare:
            with timing.stage("cut"):
                piece = _chunk_bytes(view, target.chunk, spare)
            if on_chunk is not None:
                on_chunk(sub, piece if piece.shape == view.shape else view)
            written += _write_file(path := target.path(tuple(a for a, _ in sub)), piece, target.direct, target.sync)
        sequential_file.closed(path)  # (writers.remote: a chunk spooled for a bucket goes up now)
    return written


def _chunk_bytes(piece: np.ndarray, chunk: tuple[int, ...], spare: np.ndarray | None = None) -> np.ndarray:
    """The whole chunk whose stored part is `piece` (a view into a tile), as a C-contiguous array:
    `piece` itself where it is one (a chunk of whole rows of the tile), else one copy into a
    4 KiB-aligned buffer (`spare`, lent by the import's pool, else a fresh one), so it is still
    written with O_DIRECT: a chunk that is a strip
    of the tile (a tile of several chunks side by side along a later axis: the joined strips of
    an fsdp-cut `[vocab, embed]` row) or an edge chunk (zarr v2 stores it whole, padded with
    zeros). Before, a strip went through `np.ascontiguousarray` (an unaligned buffer) and so
    through the page cache: a second copy of its bytes, in the kernel."""
    if piece.shape == chunk and piece.flags.c_contiguous:
        return piece
    full = aligned_empty(chunk, piece.dtype) if spare is None else spare  # (`spare`: lent, `write_tile`)
    if piece.shape != chunk:  # the padding of an edge chunk
        full[...] = 0
    full[tuple(slice(0, n) for n in piece.shape)] = piece
    return full


def _write_file(path: str, data: np.ndarray, direct: bool = False, sync: bool = True) -> int:
    """`data`'s bytes as the whole file `path` (created or truncated), fsync'd where `sync`;
    with O_DIRECT where `direct`, the bytes are whole aligned blocks and the filesystem takes it."""
    view = memoryview(data.reshape(-1).view(np.uint8))
    if direct and len(view) and len(view) % DIRECT_ALIGN == 0 and data.ctypes.data % DIRECT_ALIGN == 0:
        if _write_direct(path, view, sync):
            return len(view)
    fd = None
    try:
        with timing.stage("write"):  # (its bytes: added once written)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_all(fd, view)
            timing.add_bytes(len(view))
        if sync:
            with timing.stage("sync"):
                os.fsync(fd)
    finally:
        if fd is not None:
            os.close(fd)
    return len(view)


def _write_direct(path: str, view: memoryview, sync: bool = True) -> bool:
    """Write `view` as the file `path` with O_DIRECT and fsync it where `sync`; False (nothing
    kept) where the filesystem refuses O_DIRECT (`io.direct_io`)."""
    fd = None
    try:
        with timing.stage("write"):  # (its bytes: added once written)
            fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            if fd is None:
                return False
            _write_all(fd, view)
            timing.add_bytes(len(view))
        if sync:
            with timing.stage("sync"):
                os.fsync(fd)
    except OSError as e:
        if not refused(path, e):
            raise
        return False  # the caller rewrites the file buffered (O_TRUNC)
    finally:
        if fd is not None:
            os.close(fd)
    return True


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])

