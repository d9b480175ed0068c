"""torch.distributed.checkpoint (DCP) `.metadata` WRITTEN without torch: the objects
`FileSystemWriter.finish` pickles (`pickle.dump(metadata, f)`, protocol 4), built from `emit`.

The object graph (pytorch/pytorch: torch/distributed/checkpoint/metadata.py, filesystem.py;
`containers.dcp_metadata` reads the same):

    Metadata(state_dict_metadata={fqn: TensorStorageMetadata(properties, size, chunks)
                                       | BytesStorageMetadata()},
             planner_data={fqn: key path tuple},
             storage_data={MetadataIndex(fqn, offset, index): _StorageInfo(relative_path,
                                                                           offset, length)},
             storage_meta=StorageMeta(checkpoint_id=PosixPath, save_id, load_id=None, modules=[]),
             version="1.0.0")

Each object pickles as its dataclass instance does (`copyreg.__newobj__` + its `__dict__`):
`TensorProperties` by its `__getstate__` tuple `(dtype, layout, requires_grad,
_MEM_FORMAT_ENCODING(0), pin_memory)`, the layout as `torch.serialization._get_layout(
"torch.strided")`, sizes and offsets as `torch.Size(tuple)`, `MetadataIndex` with `fqn`,
`index` (the chunk's position in its tensor's chunk list; None for a byte item) and `offset`
(absent for a byte item), `_StorageInfo` without its None `transform_descriptors`. One layout,
one memory format and one class object each are shared, as in torch's own pickle.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridckpt.containers.pickle.emit import Global, Obj, Reduce, dumps
from hybridckpt.containers.torch_save_write import torch_dtype_name

DCP_VERSION = "1.0.0"  # filesystem.py CURRENT_DCP_VERSION (torch 2.5 .. 2.13)
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_CLS = {n: Global(_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                    "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                    "StorageMeta")}  # fmt: skip
_STORAGE_INFO = Global(_FS, "_StorageInfo")
_SIZE = Global("torch", "Size")
_STRIDED = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS = Reduce(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,))
_DTYPES: dict[str, Global] = {}


@dataclass(frozen=True)
class Stored:
    """Where one saved piece lies: `[offset, offset + length)` of `file` (a name in the folder)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class ChunkOut:
    """One chunk of a tensor: `offsets`, `sizes` (elements per dim) and where it was written."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: Stored


@dataclass(frozen=True)
class TensorOut:
    """A global tensor: `fqn`, numpy `dtype`, global `shape`, its `chunks` (tiling it)."""

    fqn: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkOut, ...]


@dataclass(frozen=True)
class BytesOut:
    """A `torch.save`d Python value under `fqn`."""

    fqn: str
    stored: Stored


def _size(dims: Sequence[int]) -> Reduce:
    return Reduce(_SIZE, (tuple(int(d) for d in dims),))


def _dtype(dtype) -> Global:
    name = torch_dtype_name(dtype)
    return _DTYPES.setdefault(name, Global("torch", name))


def _tensor_md(t: TensorOut) -> Obj:
    props = Obj(_CLS["TensorProperties"], (_dtype(t.dtype), _STRIDED, False, _CONTIGUOUS, False))
    chunks = [Obj(_CLS["ChunkStorageMetadata"], {"offsets": _size(c.offsets), "sizes": _size(c.sizes)})
              for c in t.chunks]  # fmt: skip
    return Obj(
        _CLS["TensorStorageMetadata"],
        {"properties": props, "size": _size(t.shape), "chunks": chunks},
    )


def _info(s: Stored) -> Obj:
    return Obj(
        _STORAGE_INFO, {"relative_path": s.file, "offset": int(s.offset), "length": int(s.length)}
    )


def metadata_bytes(
    entries: Sequence[TensorOut | BytesOut],
    written: Sequence[tuple[str, int | None]],
    planner_data: Mapping[str, tuple] | None,
    checkpoint_id: str,
    save_id: str,
    id_as_path: bool = True,
) -> bytes:
    """The `.metadata` pickle. `entries` in state-dict order (its `state_dict_metadata`);
    `written`: `(fqn, chunk index or None)` in the order the pieces were written (its
    `storage_data`); `planner_data`: fqn -> key path (None: Megatron's planner records none);
    `checkpoint_id`: the folder's absolute path (a PosixPath, as `FileSystemWriter` records
    it, or a str, as Megatron passes it: `id_as_path`; informational)."""
    by_fqn = {e.fqn: e for e in entries}
    fqn = {e.fqn: sys.intern(e.fqn) for e in entries}  # one string object per name, as torch's
    sdm = {fqn[e.fqn]: _tensor_md(e) if isinstance(e, TensorOut) else Obj(_CLS["BytesStorageMetadata"])
           for e in entries}  # fmt: skip
    storage = {}
    for name, index in written:
        e = by_fqn[name]
        if index is None:
            key = Obj(_CLS["MetadataIndex"], {"fqn": fqn[name], "index": None})
            storage[key] = _info(e.stored)
        else:
            c = e.chunks[index]
            key = Obj(
                _CLS["MetadataIndex"],
                {"fqn": fqn[name], "index": index, "offset": _size(c.offsets)},
            )
            storage[key] = _info(c.stored)
    parts = tuple(p for p in os.path.abspath(checkpoint_id).split(os.sep) if p)
    where = (
        Reduce(Global("pathlib", "PosixPath"), (os.sep, *parts))
        if id_as_path
        else os.path.abspath(checkpoint_id)
    )
    meta = Obj(_CLS["StorageMeta"], {
        "checkpoint_id": where,
        "save_id": save_id, "load_id": None, "modules": [],
    })  # fmt: skip
    planner = (
        None if planner_data is None else {fqn.get(k, k): tuple(v) for k, v in planner_data.items()}
    )
    return dumps(Obj(_CLS["Metadata"], {
        "state_dict_metadata": sdm, "planner_data": planner, "storage_data": storage,
        "storage_meta": meta, "version": DCP_VERSION,
    }), protocol=4)  # fmt: skip
