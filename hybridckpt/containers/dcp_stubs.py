"""DCP's pickled classes as the restricted unpickler hands them over: inert stubs, read here.

`Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)` (pytorch/
pytorch: torch/distributed/checkpoint/metadata.py; megatron-core 0.15 pickles its subclass
`MCoreMetadata`, NVIDIA/Megatron-LM@core_v0.15.0: megatron/core/dist_checkpointing/strategies/
torch.py) becomes a `Stub` whose fields are attributes; `TensorProperties` pickles as the tuple
`(dtype, layout, requires_grad, _MEM_FORMAT_ENCODING, pin_memory)` (a dict in older torch);
`torch.Size` is a tuple of ints.

`extract` copies what a reader needs into `RawTables` columns (`containers.dcp_tables`): each
tensor's fqn, dtype and shape and its chunks, each storage entry; the two readers of the pickle
share it (the general machine hands it lists of chunk stubs; the specialised reader,
`containers.dcp_fast`, hands it the chunk rows it already wrote, by list).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt.containers.dcp_tables import MAX_DIMS, RawTables
from hybridckpt.containers.pickle.allow import Policy, Stub
from hybridckpt.containers.pickle.torch_policy import TORCH_POLICY, TorchDtype
from hybridckpt.errors import FormatError

# DCP classes across torch versions (older torch kept some under torch.distributed._shard)
DCP_POLICY = TORCH_POLICY.merged(
    Policy(stub_prefixes=("torch.distributed.checkpoint.", "torch.distributed._shard."))
)

METADATA_CLASSES = ("Metadata", "MCoreMetadata")


def attr(obj: Any, name: str, what: str):
    if isinstance(obj, Stub) and name in vars(obj):
        return vars(obj)[name]
    if isinstance(obj, Mapping) and name in obj:
        return obj[name]
    raise FormatError(f"{what}: expected a field '{name}' in {type(obj).__name__}")


def kind(obj: Any) -> str:
    return type(obj).stub_name if isinstance(obj, Stub) else type(obj).__name__


def ints(x: Any, what: str) -> tuple[int, ...]:
    """A tuple of non-negative ints (at most `MAX_DIMS`; bools refused)."""
    if (
        not isinstance(x, (tuple, list))
        or len(x) > MAX_DIMS
        or not all(type(i) is int and i >= 0 for i in x)
    ):
        raise FormatError(f"{what}: expected a tuple of non-negative ints, found {x!r}")
    return tuple(x)


def dtype(props: Any, what: str) -> np.dtype:
    state = vars(props).get("stub_state") if isinstance(props, Stub) else None
    if isinstance(state, tuple) and state:  # TensorProperties.__getstate__ tuple
        dt = state[0]
    elif isinstance(props, Stub) and "dtype" in vars(props):
        dt = vars(props)["dtype"]
    else:
        raise FormatError(f"{what}: tensor properties carry no dtype ({props!r})")
    if not isinstance(dt, TorchDtype):
        raise FormatError(f"{what}: dtype {dt!r} is not a torch dtype")
    if dt.numpy is None:
        raise FormatError(f"{what}: torch.{dt.name} has no numpy dtype to read into")
    return np.dtype(dt.numpy)


def planner(data: Any) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    if isinstance(data, Mapping):
        for k, v in data.items():
            if isinstance(k, str) and isinstance(v, (tuple, list)):
                out[k] = tuple(v)
    return out


def storage_entry(raw: RawTables, idx: Any, info: Any, path: str) -> None:
    """One `MetadataIndex -> _StorageInfo` pair into `raw`'s storage columns, checked."""
    fqn = attr(idx, "fqn", path)
    if not isinstance(fqn, str):
        raise FormatError(f"{path}: storage entry fqn {fqn!r} is not a string")
    off = vars(idx).get("offset") if isinstance(idx, Stub) else None
    key_off = None if off is None else ints(off, f"{path}: '{fqn}' offset")
    tds = vars(info).get("transform_descriptors") if isinstance(info, Stub) else None
    if tds:
        raise FormatError(
            f"{path}: '{fqn}' is stored with transforms {list(tds)!r}, which are not supported"
        )
    rel = attr(info, "relative_path", path)
    offset, length = attr(info, "offset", path), attr(info, "length", path)
    if not (type(offset) is int and type(length) is int and 0 <= offset < 1 << 62 and 0 <= length < 1 << 62):
        raise FormatError(f"{path}: '{fqn}' storage offset/length {offset!r}/{length!r}")
    if not isinstance(rel, str):
        raise FormatError(f"{path}: '{fqn}' storage path {rel!r} is not a string")
    raw.add_storage(fqn, key_off, rel, offset, length)


def chunk_row(raw: RawTables, c: Any, what: str) -> None:
    """One `ChunkStorageMetadata(offsets, sizes)` into `raw`'s chunk columns, checked."""
    offs = ints(attr(c, "offsets", what), f"{what} chunk offsets")
    sizes = ints(attr(c, "sizes", what), f"{what} chunk sizes")
    if len(offs) != len(sizes):
        raise FormatError(f"{what}: chunk at offsets {offs} has {len(sizes)} sizes")
    if any(x >= 1 << 62 for x in offs + sizes):
        raise FormatError(f"{what}: chunk at offsets {offs} sizes {sizes} is out of range")
    if len(raw.c_coords) + len(raw.c_nd) + 1 + 2 * len(offs) > raw.budget:
        raise FormatError(
            f"{what}: more chunk numbers than a file of its size holds ({raw.budget}): chunk objects "
            f"fetched again and again from the memo; refused"
        )
    raw.add_chunk(offs, sizes)


def extract(md: Any, raw: RawTables, path: str, rows_of=None, storage_done: bool = False):
    """Tensors, byte items and storage entries of a `Metadata` stub into `raw`.

    `rows_of(list) -> (first, count) or None`: chunk rows a reader already wrote for a chunk list
    (the specialised reader); other lists are read chunk by chunk. `storage_done`: the storage
    entries are in `raw` already. Returns `(byte item fqns, planner_data, version, written_to)`."""
    if kind(md) not in METADATA_CLASSES:
        raise FormatError(f"{path}: expected a DCP Metadata pickle, found {kind(md)}")
    sdm = attr(md, "state_dict_metadata", path)
    if not isinstance(sdm, Mapping):
        raise FormatError(f"{path}: state_dict_metadata is {type(sdm).__name__}, not a dict")
    if not storage_done:
        storage = attr(md, "storage_data", path) if "storage_data" in vars(md) else None
        if not isinstance(storage, Mapping):
            raise FormatError(f"{path}: storage_data is {type(storage).__name__}, not a dict of chunks")
        for idx, info in storage.items():
            storage_entry(raw, idx, info, path)
    byte_items: list[str] = []
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise FormatError(f"{path}: state_dict_metadata key {fqn!r} is not a string")
        k = kind(entry)
        what = f"{path}: '{fqn}'"
        if k == "BytesStorageMetadata":
            byte_items.append(fqn)
        elif k == "TensorStorageMetadata":
            dt = dtype(attr(entry, "properties", what), what)
            shape = ints(attr(entry, "size", what), f"{what} size")
            chunks = attr(entry, "chunks", what)
            done = rows_of(chunks) if rows_of is not None else None
            if done is not None:
                first, count = done
            else:
                if not isinstance(chunks, (list, tuple)):
                    raise FormatError(f"{what}: chunks is {type(chunks).__name__}, not a list")
                first = len(raw.c_nd)
                for c in chunks:
                    chunk_row(raw, c, what)
                count = len(raw.c_nd) - first
            raw.tensors.append((fqn, dt, shape, first, count))
        else:
            raise FormatError(f"{what}: unknown storage metadata {k}")
    version = vars(md).get("version")
    sm = vars(md).get("storage_meta")
    written = vars(sm).get("checkpoint_id") if isinstance(sm, Stub) else None
    return byte_items, planner(vars(md).get("planner_data")), version, written
