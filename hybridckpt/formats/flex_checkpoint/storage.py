"""The `.distcp` data files of a FlexCheckpoint, and global tensors assembled from their blocks.

Data files (PaddlePaddle/Paddle: python/paddle/distributed/flex_checkpoint/dcp/save_state_dict.py
`save_state_dict`: `paddle.save(local_state_dict, "{rank}_{id}.distcp", safetensors=...)`):
- by default a `paddle.save` pickle of `{key: ndarray}` plus a `StructuredToParameterName@@`
  name table (`hybridckpt.containers.pickle.paddle_save`: arrays at byte offsets, read lazily);
  bfloat16 is stored as uint16 bits and viewed as bfloat16 from the metadata's dtype;
- with `safetensors=True` a safetensors file keyed the same way.
A file is parsed the first time one of its blocks is read (opening a checkpoint reads only its
metadata), then only the bytes of each box.

Assembly (load_state_dict.py `restore_unflattened_state_dict`, utils.py `minimal_nd_slice`):
- a plain block is the sub-array `[offset, offset + shape)` of the global tensor;
- a flattened block (sharding stage1 v2, stage3: `is_flattened`) is a 1-D piece holding
  elements `[start, stop)` of the C-order flattening of the block `shape` at `offset` (the TP
  shard of a parameter, or the whole parameter): the pieces of one block, in `start` order, must
  cover `[0, prod(shape))` exactly; they are joined and reshaped lazily (a box reads only the
  ranges it needs from each piece);
- the blocks must tile the global shape exactly (`containers.dcp_metadata.check_tiling`).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.dcp_metadata import Chunk, check_tiling
from hybridckpt.containers.pickle import paddle_save
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import FormatError
from hybridckpt.formats.flex_checkpoint.metadata import Block, FlexMetadata
from hybridckpt.io.byte_source import ByteSource, real_reads
from hybridckpt.lazy import Deferred, LazyTensor, tiled


class DistcpFile:
    """One `.distcp` file, parsed once on first use: key -> stored LazyTensor."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._tensors: dict[str, LazyTensor] | None = None

    def tensors(self) -> dict[str, LazyTensor]:
        with self._lock:
            if self._tensors is None:
                self._tensors = self._parse()
            return self._tensors

    def _parse(self) -> dict[str, LazyTensor]:
        source = ByteSource(self.path)  # a FIFO or device refused, never waited on; in a bucket: one ranged GET
        with real_reads():  # metadata, read for real under a planned import too
            head = source.read(0, min(9, source.size()))
        # safetensors: an 8-byte little-endian header length, then the JSON header; a protocol
        # 2-5 pickle starts with PROTO, and its first 8 bytes read as a length past the file end
        n = int.from_bytes(head[:8], "little")
        if len(head) == 9 and head[8:9] == b"{" and 8 + n <= os.path.getsize(self.path):
            return dict(read_header(self.path).tensors)  # saved with safetensors=True
        return dict(paddle_save.read(self.path).tensors)


@dataclass(frozen=True, eq=False)
class StoredBlock(Deferred):
    """The array `block.key` of `block.file` (a plain block, or the 1-D piece of a flattened
    one); its shape and dtype are checked against the metadata on first read."""

    block: Block
    file: DistcpFile
    _checked: list = field(default_factory=list, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.block.stored_shape

    @property
    def dtype(self) -> np.dtype:
        return self.block.dtype

    def tensor(self) -> LazyTensor:
        if self._checked:
            return self._checked[0]
        b = self.block
        t = self.file.tensors().get(b.key)
        if t is None:
            raise FormatError(
                f"{b.file}: has no entry {b.key!r}, which the metadata says is stored here"
            )
        if np.dtype(t.dtype) == np.uint16 and b.dtype.itemsize == 2 and b.dtype != np.uint16:
            t = paddle_save.reinterpret(t, b.dtype)  # bfloat16 / float16 bits
        if tuple(t.shape) != self.shape or np.dtype(t.dtype) != b.dtype:
            raise FormatError(
                f"{b.file}: {b.key!r} is {t.dtype} {tuple(t.shape)}, the metadata says "
                f"{b.dtype} {self.shape}"
            )
        self._checked.append(t)
        return t


def _unflatten(key: str, pieces: list[StoredBlock], where: str) -> LazyTensor:
    """A flattened block from its 1-D pieces: they must cover its elements exactly once."""
    b0 = pieces[0].block
    numel = math.prod(b0.shape)
    pieces = sorted(pieces, key=lambda p: p.block.flat[0])
    pos = 0
    for p in pieces:
        start, stop = p.block.flat
        if start != pos:
            what = "overlap" if start < pos else f"leave elements [{pos}, {start}) out"
            raise FormatError(
                f"{where}: flattened pieces of {key!r} (block at {b0.offset}) {what}: "
                f"ranges {[p.block.flat for p in pieces]} of {numel} elements"
            )
        pos = stop
    if pos != numel:
        raise FormatError(
            f"{where}: flattened pieces of {key!r} (block at {b0.offset}) end at element {pos} of "
            f"{numel}: ranges {[p.block.flat for p in pieces]}"
        )
    return lazy.reshape(lazy.concat(pieces, 0), b0.shape)


def global_tensor(
    key: str, blocks: tuple[Block, ...], files: dict[str, DistcpFile], where: str
) -> LazyTensor:
    """The global tensor `key` from its stored blocks (plain or flattened)."""
    whole: dict[tuple, LazyTensor] = {}
    flat: dict[tuple, list[StoredBlock]] = {}
    for b in blocks:
        f = files.setdefault(b.file, DistcpFile(b.file))
        if b.flat is None:
            if (b.offset, b.shape) in whole:
                raise FormatError(f"{where}: {key!r} has two blocks at {b.offset}")
            whole[(b.offset, b.shape)] = StoredBlock(b, f)
        else:
            flat.setdefault((b.offset, b.shape), []).append(StoredBlock(b, f))
    for (offset, shape), pieces in flat.items():
        if (offset, shape) in whole:
            raise FormatError(
                f"{where}: {key!r} block at {offset} is stored both whole and flattened"
            )
        whole[(offset, shape)] = _unflatten(key, pieces, where)
    gshape = blocks[0].global_shape
    check_tiling(key, gshape, [Chunk(o, s, "", 0, 0) for o, s in whole], where)
    return tiled(gshape, blocks[0].dtype, [(o, t) for (o, _), t in whole.items()])


def check_files(md: FlexMetadata) -> None:
    """Every data file the metadata names exists (a FormatError naming a key it holds), and the
    blocks stored in it declare (stored shape x itemsize, exact ints) no more bytes than it has:
    a metadata declaring a 4 TiB block in a file of a few KB is refused here, before a plan or a
    write is made for it (the files are parsed only on a block's first read). One line naming
    the file, the block declaring the most, the bytes declared and the bytes present."""
    declared: dict[str, list] = {}
    for key, blocks in md.blocks.items():
        for b in blocks:
            if not os.path.isfile(b.file):
                raise FormatError(
                    f"{b.file}: missing; {md.path} stores {key!r} (and maybe more) in it"
                )
            n = math.prod(b.stored_shape) * b.dtype.itemsize
            entry = declared.setdefault(b.file, [0, 0, b])
            entry[0] += n
            if n > entry[1]:
                entry[1:] = [n, b]
    for path, (total, most, b) in declared.items():
        size = os.path.getsize(path)
        if total > size:
            raise FormatError(
                f"{path}: {md.path} declares {total} bytes of blocks in this file of {size} bytes "
                f"(the most for {b.key!r}, {b.dtype} {list(b.stored_shape)}: {most} bytes); "
                f"refused before planning"
            )


def open_tensors(md: FlexMetadata) -> dict[str, LazyTensor]:
    """Every tensor of one FlexCheckpoint folder, as lazy global tensors."""
    check_files(md)
    files: dict[str, DistcpFile] = {}
    return {k: global_tensor(k, bs, files, md.path) for k, bs in md.blocks.items()}
