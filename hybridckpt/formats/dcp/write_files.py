"""A DCP folder's files, written from lazy tensors as torch's `FileSystemWriter` lays them out.

The layout (pytorch/pytorch: torch/distributed/checkpoint/filesystem.py, thread_count 1,
`single_file_per_rank`): each writer (a rank) writes one file `__{rank}_0.distcp`: its byte
items first (`torch.save`d Python values), then its tensor chunks, each a complete
`torch.save` archive of the chunk (`containers.torch_save_write`, identical to torch's own);
then `.metadata` (`containers.dcp_metadata_write`) says where every piece is.

Here the pieces are planned, not taken from ranks (`plan_pieces`): a tensor is one chunk, or
blocks of whole leading rows (`[a, b)` of dim 0, every other dim whole) of at most
`max_chunk_bytes` each; with several writer files the byte items go round robin and the chunks,
largest first, each to the least filled file (torch's `_split_by_size_and_type`). A loader
reshards whatever the chunks are (DCP reads any box from any tiling).

Streaming: each chunk is read in row blocks of at most `WRITE_BLOCK_BYTES` (the reader pool) and
written through `io.sequential_file` (O_DIRECT where the filesystem allows), its CRC-32 folded
in as it goes; a chunk whose bytes already lie in files in order (a stored array, a DCP chunk)
is copied file to file (`lazy.copy_runs`), never materialised. Peak memory: a couple of blocks.
"""

from __future__ import annotations

import math
import os
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.dcp_metadata_write import (
    BytesOut,
    ChunkOut,
    Stored,
    TensorOut,
    metadata_bytes,
)
from hybridckpt.containers.safetensors_file import WRITE_BLOCK_BYTES
from hybridckpt.containers.torch_save_write import MAX_ARCHIVE, TensorArchive, object_archive
from hybridckpt.io.sequential_file import SequentialFile
from hybridckpt.lazy import LazyTensor

DEFAULT_CHUNK_BYTES = 1 << 30  # a tensor larger than this is saved as row blocks


@dataclass(frozen=True)
class Item:
    """One entry of the state dict: `path` (its nested key path: `("model", "lm_head.weight")`,
    `("optim", "param_groups", 0, "lr")`; the fqn is the path joined by dots, or `key` when
    given) and either a `tensor` or a plain Python `value` (saved as a byte item).

    `boxes`: the tensor's chunks, as the saving ranks would hold them (each `((start, stop),
    ...)` per dim; they must tile it), else planned (module doc); `files`: the writer file of
    each box (of the byte item: one), else planned."""

    path: tuple
    tensor: LazyTensor | None = None
    value: Any = None
    key: str | None = None
    boxes: tuple | None = None
    files: tuple[int, ...] | None = None

    @property
    def fqn(self) -> str:
        return self.key if self.key is not None else ".".join(map(str, self.path))


@dataclass(frozen=True)
class _Piece:
    fqn: str
    index: int | None  # chunk index (None: a byte item)
    box: tuple[tuple[int, int], ...] | None
    nbytes: int


def row_blocks(
    shape: tuple[int, ...], itemsize: int, max_bytes: int
) -> list[tuple[tuple[int, int], ...]]:
    """The chunk boxes of a tensor: the whole tensor, or blocks of whole rows of dim 0 of at
    most `max_bytes` each (at least one row)."""
    whole = tuple((0, n) for n in shape)
    row = math.prod(shape[1:]) * itemsize
    if not shape or row == 0 or shape[0] * row <= max_bytes:
        return [whole]
    step = max(1, max_bytes // row)
    return [((a, min(shape[0], a + step)), *whole[1:]) for a in range(0, shape[0], step)]


def split_box(box: tuple[tuple[int, int], ...], itemsize: int, max_bytes: int) -> list:
    """`box` as blocks of at most `max_bytes`: cut on its first axis longer than 1 (a unit of
    that axis still too large is cut on the next axes)."""
    sizes = [b - a for a, b in box]
    if math.prod(sizes) * itemsize <= max_bytes:
        return [box]
    axis = next(i for i, n in enumerate(sizes) if n > 1)
    unit = math.prod(sizes[axis + 1 :]) * itemsize * math.prod(sizes[:axis])
    step = max(1, max_bytes // max(unit, 1))
    out = []
    a0, b0 = box[axis]
    for a in range(a0, b0, step):
        part = (*box[:axis], (a, min(b0, a + step)), *box[axis + 1 :])
        out += split_box(part, itemsize, max_bytes) if step == 1 and unit > max_bytes else [part]
    return out


def item_boxes(it: Item, max_chunk_bytes: int) -> list:
    """The chunks `it` is saved as: its `boxes` (each cut to the size limit) or row blocks."""
    t = it.tensor
    size = np.dtype(t.dtype).itemsize
    limit = min(max_chunk_bytes, MAX_ARCHIVE // 2)
    if it.boxes is None:
        return row_blocks(tuple(t.shape), size, limit)
    return [b for box in it.boxes for b in split_box(tuple(box), size, limit)]


def plan_pieces(items: Sequence[Item], files: int, max_chunk_bytes: int) -> list[list[_Piece]]:
    """Which pieces each writer file holds, in write order (module doc); an item's own `files`
    place its pieces, the rest are planned."""
    bins: list[list[_Piece]] = [[] for _ in range(files)]
    chunks: list[_Piece] = []
    n_bytes = 0
    for it in items:
        if it.tensor is None:
            at = it.files[0] if it.files else n_bytes % files
            bins[at].append(_Piece(it.fqn, None, None, 0))
            n_bytes += it.files is None
            continue
        size = np.dtype(it.tensor.dtype).itemsize
        placed = _placed(it, max_chunk_bytes)
        for i, box in enumerate(item_boxes(it, max_chunk_bytes)):
            piece = _Piece(it.fqn, i, box, math.prod(b - a for a, b in box) * size)
            if placed is None:
                chunks.append(piece)
            else:
                bins[placed[i]].append(piece)
    if files == 1:
        bins[0] += chunks
        return bins
    load = [sum(p.nbytes for p in b) for b in bins]
    for p in sorted(chunks, key=lambda p: -p.nbytes):  # stable: plan order among equals
        i = min(range(files), key=lambda j: load[j])
        bins[i].append(p)
        load[i] += p.nbytes
    return bins


def _placed(it: Item, max_chunk_bytes: int) -> list[int] | None:
    """The file of each of `it`'s (cut) chunks when the item places its boxes, else None."""
    if it.files is None or it.boxes is None:
        return None
    size = np.dtype(it.tensor.dtype).itemsize
    limit = min(max_chunk_bytes, MAX_ARCHIVE // 2)
    return [
        f
        for box, f in zip(it.boxes, it.files, strict=True)
        for _ in split_box(tuple(box), size, limit)
    ]


class _Crc:
    """Folds the bytes fed to it into a CRC-32 (and feeds a store read check, if any)."""

    def __init__(self, inner=None):
        self.value = 0
        self.inner = inner

    def feed(self, view) -> None:
        self.value = zlib.crc32(view, self.value)
        if self.inner is not None:
            self.inner.feed(view)


def _write_chunk(out: SequentialFile, t: LazyTensor, box) -> int:
    """One chunk's torch.save archive at the end of `out`; returns its length in bytes."""
    whole = all((a, b) == (0, n) for (a, b), n in zip(box, t.shape, strict=True))
    view = t if whole else lazy.Slice(t, tuple(box))
    archive = TensorArchive(tuple(view.shape), t.dtype)
    out.write(archive.head)
    crc = _Crc()
    runs = lazy.copy_runs(view)
    if runs is not None:  # bytes already in files, in order: copied, never materialised
        for r in runs:
            crc.inner = r.check
            out.copy_run(r.source, r.offset, r.nbytes, crc)
    else:
        from hybridckpt.lazy.parallel import read_box_parallel

        for rows in row_blocks(tuple(view.shape), np.dtype(t.dtype).itemsize, WRITE_BLOCK_BYTES):
            arr = np.ascontiguousarray(read_box_parallel(view, rows))
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            raw = arr.reshape(-1).view(np.uint8)
            crc.feed(raw)
            out.write(raw)
            del arr, raw
    out.write(archive.tail(crc.value))
    return archive.length


def write_folder(
    folder: str,
    items: Sequence[Item],
    *,
    files: int = 1,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    direct_io: bool = True,
    checkpoint_id: str | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
    planner: bool = True,
    id_as_path: bool = True,
) -> list[str]:
    """Write `items` as a DCP checkpoint into the existing folder `folder` (module doc):
    `__{r}_0.distcp` for r < `files`, then `.metadata`. `checkpoint_id`: the path recorded in
    the metadata (the destination the folder will be renamed to; a PosixPath, as torch's
    `FileSystemWriter` records it, or the string Megatron passes: `id_as_path`). `planner`:
    record the key paths (`dcp.save`'s planner does; Megatron's saves none). Returns the file
    names."""
    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    by_fqn = {it.fqn: it for it in items}
    if len(by_fqn) != len(items):
        raise ValueError("two state-dict entries have the same fqn")
    bins = plan_pieces(items, files, max_chunk_bytes)
    stored: dict[tuple[str, int | None], Stored] = {}
    written: list[tuple[str, int | None]] = []
    names = []
    for rank, pieces in enumerate(bins):
        name = f"__{rank}_0.distcp"
        names.append(name)
        with SequentialFile(os.path.join(folder, name), direct=direct_io) as out:
            for p in sorted(pieces, key=lambda p: p.index is not None):  # byte items first
                at = out.position
                it = by_fqn[p.fqn]
                if p.index is None:
                    blob = object_archive(it.value)
                    out.write(blob)
                    length = len(blob)
                else:
                    length = _write_chunk(out, it.tensor, p.box)
                    if on_tensor is not None:
                        on_tensor(p.fqn, p.nbytes)
                stored[(p.fqn, p.index)] = Stored(name, at, length)
                written.append((p.fqn, p.index))
    entries = []
    for it in items:
        if it.tensor is None:
            entries.append(BytesOut(it.fqn, stored[(it.fqn, None)]))
            continue
        boxes = item_boxes(it, max_chunk_bytes)
        chunks = tuple(ChunkOut(tuple(a for a, _ in b), tuple(e - a for a, e in b), stored[(it.fqn, i)])
                       for i, b in enumerate(boxes))  # fmt: skip
        entries.append(TensorOut(it.fqn, np.dtype(it.tensor.dtype), tuple(it.tensor.shape), chunks))
    paths = {it.fqn: tuple(it.path) for it in items} if planner else None
    blob = metadata_bytes(
        entries, written, paths, checkpoint_id or folder, str(uuid.uuid4()), id_as_path
    )
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    return [*names, ".metadata"]
