"""Where a DCP folder's bytes are: its files, chunks, safetensors blobs and shards.

Three layouts (pytorch/pytorch: torch/distributed/checkpoint/{metadata,filesystem,hf_storage}.py):
- `.metadata` (or rank-local `__{rank}.metadata`, `containers.dcp_metadata`) + `__{rank}_{n}.distcp`
  files of `torch.save` chunks at the byte ranges the metadata gives (`views.TorchSaveChunk`);
  byte items (param-group values, ...) are `torch.save`d objects.
- `FileSystemWriter(serialization_format=SAFETENSORS)`: each `.distcp` file is one safetensors
  blob keyed by fqn (offsets from its `DCP_SHARDING_INFO`); the `.metadata` byte ranges do not
  locate the data then, the safetensors header does (`safetensors_blobs`).
- `HuggingFaceStorageWriter(save_distributed=True)`, no `.metadata`:
  `shard-{rank:05d}-model-{i:05d}-of-{n:05d}.safetensors` files, each tensor a chunk whose
  global offsets are `json.loads(__metadata__["DCP_SHARDING_INFO"])[fqn]["saved_offsets"]`; the
  global shape is the maximum of `offset + size` per dim, as torch's reader computes it
  (`read_hf_shards`).
"""

from __future__ import annotations

import builtins
import math
import os
import re
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from hybridckpt.containers.dcp_metadata import (
    Chunk,
    DcpMetadata,
    TensorEntry,
    check_tiling,
    metadata_files,
)
from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import FormatError
from hybridckpt.formats.dcp.chunk import TorchSaveChunk
from hybridckpt.formats.dcp.chunked import Chunked
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.io.config_file import parse_json
from hybridckpt.io.remote.view import remote_object
from hybridckpt.lazy import LazyTensor, tiled

_HF_SHARD = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")
_SHARDING_KEY = "DCP_SHARDING_INFO"  # torch/distributed/checkpoint/_hf_utils.py


def hf_shards(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if _HF_SHARD.match(n)]


def _has_sharding_info(path: str) -> bool:
    try:
        return _SHARDING_KEY in read_header(path).metadata
    except FormatError:
        return False


def detect(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if metadata_files(path):
        return True
    shards = hf_shards(path)
    return bool(shards) and _has_sharding_info(shards[0])



def check_files(md: DcpMetadata) -> None:
    """Every data file the metadata names exists and holds every byte range it gives (one size
    per file; the chunks' ranges checked as columns)."""
    t = md.table
    ends = np.zeros(len(t.files), dtype=np.int64)
    if t.rows:
        np.maximum.at(ends, t.file, t.start + t.length)
    used = {t.files[i]: int(ends[i]) for i in t.used_files()}
    for b in md.bytes_items.values():
        used[b.path] = max(used.get(b.path, 0), b.offset + b.length)
    sizes: dict[str, int] = {}
    for path, end in used.items():
        if not os.path.isfile(path):
            raise FormatError(f"{path}: missing; {md.files[0]} stores '{_stored_in(md, path)}' (and maybe more) in it")
        size = sizes[path] = os.path.getsize(path)
        if end > size:
            fqn, a, b = _past(md, path, size)
            raise FormatError(
                f"{path}: '{fqn}' is stored at bytes [{a}, {b}) but the file has {size} bytes (truncated?)"
            )
    check_declared_bytes(md, sizes)


def check_declared_bytes(md: DcpMetadata, sizes: Mapping[str, int]) -> None:
    """The chunks stored in each data file declare (shape x itemsize) no more bytes than the
    file has: a few-KB `.metadata` declaring a 4 TiB tensor is refused here, before a plan or a
    write is made for it (an import planned past 90 s on one, and wrote until the disk was
    full). One line naming the file, the largest tensor declared in it, the bytes declared and
    the bytes present. Columnar: float64 products (exact to 2^53 bytes; never wraps)."""
    t = md.table
    if not t.rows:
        return
    nd = np.zeros(t.rows, dtype=np.int64)
    item = np.zeros(t.rows, dtype=np.float64)
    for e in md.tensors.values():
        nd[e.rows] = len(e.shape)
        item[e.rows] = e.dtype.itemsize
    dims = t.sizes.astype(np.float64)
    dims[np.arange(dims.shape[1])[None, :] >= nd[:, None]] = 1.0
    declared = dims.prod(axis=1) * item
    per_file = np.bincount(t.file, weights=declared, minlength=len(t.files))
    for fid in t.used_files():
        path = t.files[fid]
        if per_file[fid] > sizes[path]:
            rows = np.flatnonzero(t.file == fid)
            row = int(rows[np.argmax(declared[rows])])
            fqn = _owner(md, row)
            e = md.tensors.get(fqn)
            what = f" ({e.dtype} {list(e.shape)})" if e is not None else ""
            raise FormatError(
                f"{path}: the metadata declares {per_file[fid]:.0f} bytes of tensor data in this "
                f"file of {sizes[path]} bytes (the most for '{fqn}'{what}: {declared[row]:.0f} "
                f"bytes); refused before planning"
            )


def _stored_in(md: DcpMetadata, path: str) -> str:
    """A tensor or byte item stored in `path`."""
    for b in md.bytes_items.values():
        if b.path == path:
            return b.fqn
    fid = md.table.files.index(path)
    row = int(np.argmax(md.table.file == fid))
    return _owner(md, row)


def _owner(md: DcpMetadata, row: int) -> str:
    for e in md.tensors.values():
        if e.first <= row < e.first + e.count:
            return e.fqn
    return "?"


def _past(md: DcpMetadata, path: str, size: int) -> tuple[str, int, int]:
    """The first item stored in `path` past its `size` bytes: (fqn, start, end)."""
    for b in md.bytes_items.values():
        if b.path == path and b.offset + b.length > size:
            return b.fqn, b.offset, b.offset + b.length
    t = md.table
    fid = t.files.index(path)
    row = int(np.flatnonzero((t.file == fid) & (t.start + t.length > size))[0])
    return _owner(md, row), int(t.start[row]), int(t.start[row] + t.length[row])


def safetensors_blobs(md: DcpMetadata) -> dict[str, dict]:
    """Data files that are safetensors blobs (`FileSystemWriter(serialization_format=
    SAFETENSORS)`): path -> {fqn: (saved_offsets, StoredTensor)}. Their `.metadata` offsets and
    lengths do not locate the bytes (torch 2.13's own FileSystemReader cannot read them); the
    safetensors header does."""
    out: dict[str, dict] = {}
    for path in (md.table.files[i] for i in md.table.used_files()):
        if remote_object(path) is not None:  # a file in a bucket: one ranged read
            src = ByteSource(path)
            head = src.read(0, min(9, src.size()))
        else:  # (a metadata probe: not counted as any device's read, so the plan equals the import)
            with builtins.open(path, "rb") as f:
                head = f.read(9)
        if len(head) < 9 or head[8:9] != b"{":
            continue
        st = read_header(path)
        raw = st.metadata.get(_SHARDING_KEY)
        if raw is None:
            continue
        info = _sharding_info(path, raw)
        out[path] = {fqn: (_saved_offsets(info, fqn, path) or (), t) for fqn, t in st.tensors.items()}
    return out


def _sharding_info(path: str, raw: str) -> dict:
    return parse_json(raw, f"{path}: {_SHARDING_KEY}")


def _saved_offsets(info: dict, fqn: str, path: str) -> tuple[int, ...] | None:
    """`info[fqn]["saved_offsets"]` checked to be non-negative ints; None when `fqn` is absent."""
    entry = info.get(fqn)
    if entry is None:
        return None
    offs = entry.get("saved_offsets") if isinstance(entry, dict) else None
    if not isinstance(offs, list) or not all(
        isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs
    ):
        raise FormatError(
            f"{path}: {_SHARDING_KEY}['{fqn}'] saved_offsets is {offs!r}, expected a list of "
            f"non-negative ints"
        )
    return tuple(offs)


def _chunk(e: TensorEntry, c: Chunk, blobs: Mapping[str, dict]) -> LazyTensor:
    if c.path not in blobs:
        return TorchSaveChunk(c.path, c.offset, c.length, c.sizes, e.dtype, e.fqn)
    offs, t = blobs[c.path].get(e.fqn, (None, None))
    if t is None or offs != c.offsets or t.shape != c.sizes or np.dtype(t.dtype) != e.dtype:
        found = "nothing" if t is None else f"{t.dtype} {t.shape} at offsets {offs}"
        raise FormatError(
            f"{c.path}: safetensors entry '{e.fqn}' should be {e.dtype} {c.sizes} at offsets "
            f"{c.offsets}; found {found}"
        )
    return t


def entry_tensor(e: TensorEntry, blobs: Mapping[str, dict] = MappingProxyType({})) -> LazyTensor:
    """The global tensor of a metadata entry: its chunks over the table (`Chunked`), the chunk
    itself when one chunk is the whole tensor; a chunk table of safetensors blobs, as blobs."""
    if blobs and any(p in blobs for p in e.files()):
        chunks = e.chunks
        pieces = [(c.offsets, _chunk(e, c, blobs)) for c in chunks if math.prod(c.sizes) > 0 or len(chunks) == 1]
        return tiled(e.shape, e.dtype, pieces)
    if e.count == 1:
        (c,) = e.chunks
        if c.sizes == e.shape:
            return TorchSaveChunk(c.path, c.offset, c.length, c.sizes, e.dtype, e.fqn)
    return Chunked(e)


def read_hf_shards(folder: str, shards: list[str]) -> dict[str, LazyTensor]:
    """Global tensors of the safetensors variant, from each file's DCP_SHARDING_INFO offsets."""
    blocks: dict[str, list[tuple[tuple[int, ...], LazyTensor, str]]] = {}
    for path in shards:
        st = read_header(path)
        raw = st.metadata.get(_SHARDING_KEY)
        if raw is None:
            raise FormatError(f"{path}: no {_SHARDING_KEY} in the safetensors metadata")
        info = _sharding_info(path, raw)
        for fqn, t in st.tensors.items():
            offs = _saved_offsets(info, fqn, path)
            if offs is None or len(offs) != t.ndim:
                raise FormatError(f"{path}: '{fqn}' has no saved_offsets of {t.ndim} dims")
            blocks.setdefault(fqn, []).append((offs, t, path))
    out = {}
    for fqn, parts in blocks.items():
        nd = parts[0][1].ndim
        shape = tuple(max(o[i] + t.shape[i] for o, t, _ in parts) for i in range(nd))
        dtypes = {np.dtype(t.dtype) for _, t, _ in parts}
        if len(dtypes) != 1:
            raise FormatError(f"{folder}: '{fqn}' chunks have dtypes {sorted(map(str, dtypes))}")
        chunks = [Chunk(o, t.shape, p, 0, 0) for o, t, p in parts]
        check_tiling(fqn, shape, chunks, folder)
        out[fqn] = tiled(shape, dtypes.pop(), [(o, t) for o, t, _ in parts])
    return out


def load_item(md: DcpMetadata, fqn: str):
    """A byte item (a `torch.save`d object, e.g. a param-group value) of the checkpoint."""
    b = md.bytes_items[fqn]
    return torch_save.load(b.path, base_offset=b.offset, length=b.length)
