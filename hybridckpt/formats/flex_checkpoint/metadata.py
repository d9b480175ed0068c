"""A FlexCheckpoint `{id}.metadata` file, read without paddle.

Format (PaddlePaddle/Paddle: python/paddle/distributed/flex_checkpoint/dcp/metadata.py,
save_state_dict.py `save_state_dict`, utils.py `extract_tensor_metadata`,
`write_to_file_if_empty`; checked against paddlepaddle 3.3.1):
- `paddle.save(Metadata(...), "{id}.metadata")`: a protocol-4 pickle of the dataclass
  `paddle.distributed.flex_checkpoint.dcp.metadata.Metadata` with
  - `state_dict_metadata: {key: [LocalTensorMetadata, ...]}`, one entry per stored block:
    `global_offset` (tuple, elements), `local_shape` (tuple), `dtype` ("float32", "bfloat16",
    ... : `str(tensor.dtype).split(".")[1]`), `global_shape`, `is_flattened`, `flattened_range`
    (`(start, stop)` in the C-order flattening of `local_shape`, or None);
  - `storage_metadata: {LocalTensorIndex: "{rank}_{id}.distcp"}`: where each block lies.
    `LocalTensorIndex(tensor_key, global_offset, is_flattened, flattened_range, replica_id,
    local_shape)`; a replicated block is stored once, in the file `balanced_dedup_key_in_dict`
    chose (not by rank number), or once per replica with `replica_id` 0, 1, ... when saved with
    `save_replicas`; older Paddle releases wrote only `(tensor_key, global_offset)`;
  - `flat_mapping: {flat key: tuple of nested keys}` (nested state dicts; unused here).
- The classes are never imported: they unpickle as inert stubs (`FLEX_POLICY`), whose fields are
  checked here and copied into this module's frozen dataclasses.

`read_metadata(folder)` picks the metadata of the newest save (`get_max_id`: the largest `{id}`
among `{rank}_{id}.distcp`), and returns one `Block` per stored piece.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from hybridckpt.containers.pickle.allow import Policy, Stub, short_repr
from hybridckpt.containers.pickle.base_policy import BASE_ALLOWED
from hybridckpt.containers.pickle.machine import safe_load_file
from hybridckpt.errors import FormatError
from hybridckpt.formats.flex_checkpoint.folders import DISTCP_RE, METADATA_RE

FLEX_POLICY = Policy(BASE_ALLOWED, ("paddle.", "paddlenlp.", "paddleformers.", "paddlefleet."))
"""Plain containers and guarded numpy; every paddle / PaddleNLP / PaddleFormers class a stub."""

DTYPES: Mapping[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}


@dataclass(frozen=True)
class Block:
    """One stored piece of a tensor.

    key:          the state-dict key (`model.layers.0.self_attn.q_proj.weight`)
    dtype:        numpy dtype of the stored elements (bfloat16 stored as uint16 bits)
    global_shape: shape of the whole tensor
    offset:       where the block starts in the global tensor (elements per dim)
    shape:        the block's shape (`local_shape`)
    flat:         None, or `(start, stop)`: the piece holds only these elements of the block's
                  C-order flattening, as a 1-D array (sharding stage1 v2 / stage3)
    file:         the `.distcp` file holding it (absolute path)
    """

    key: str
    dtype: np.dtype
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None
    file: str

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the array in the file."""
        return (self.flat[1] - self.flat[0],) if self.flat is not None else self.shape


@dataclass(frozen=True)
class FlexMetadata:
    """`path`: the metadata file; `blocks`: key -> its stored pieces; `files`: data files named."""

    path: str
    blocks: Mapping[str, tuple[Block, ...]]
    files: tuple[str, ...]


def data_files(folder: str) -> dict[int, list[str]]:
    """`{id: [file names]}` of the `{rank}_{id}.distcp` files of `folder`."""
    out: dict[int, list[str]] = {}
    for name in sorted(os.listdir(folder)):
        m = DISTCP_RE.match(name)
        if m:
            out.setdefault(int(m.group("id")), []).append(name)
    return out


def metadata_path(folder: str) -> str:
    """The `{id}.metadata` of the newest save in `folder` (Paddle's `get_max_id`)."""
    ids = {int(m.group("id")) for n in os.listdir(folder) if (m := METADATA_RE.match(n))}
    if not ids:
        raise FormatError(
            f"{folder}: no {{id}}.metadata file (a FlexCheckpoint folder has 0.metadata)"
        )
    files = data_files(folder)
    want = max(files) if files else max(ids)
    path = os.path.join(folder, f"{want}.metadata")
    if want not in ids:
        raise FormatError(f"{path}: missing; the folder has {files[want][0]} of save {want}")
    return path


# -- checked fields ---------------------------------------------------------------------------


def _ints(v, what: str, *, allow_none: bool = False) -> tuple[int, ...] | None:
    if v is None and allow_none:
        return None
    if isinstance(v, (tuple, list)) and all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= 0 for x in v
    ):
        return tuple(int(x) for x in v)
    raise FormatError(f"{what} is {short_repr(v)}, expected a tuple of non-negative ints")


def _field(obj, name: str, default, what: str):
    if not isinstance(obj, Stub):
        raise FormatError(f"{what}: expected a Paddle metadata object, found {short_repr(obj)}")
    return vars(obj).get(name, default)


def _of_class(obj, cls: str, what: str) -> None:
    if not (
        isinstance(obj, Stub)
        and type(obj).stub_name == cls
        and type(obj).stub_module.startswith("paddle")
    ):
        raise FormatError(f"{what}: expected a Paddle {cls}, found {short_repr(obj)}")


def _dtype(v, what: str) -> np.dtype:
    if not isinstance(v, str) or v not in DTYPES:
        raise FormatError(f"{what}: dtype {short_repr(v)} is not one of {sorted(DTYPES)}")
    return DTYPES[v]


def _entry(key: str, m, path: str) -> tuple:
    """(offset, shape, dtype, global_shape, flat) of one LocalTensorMetadata."""
    what = f"{path}: state_dict_metadata[{key!r}]"
    _of_class(m, "LocalTensorMetadata", what)
    offset = _ints(_field(m, "global_offset", None, what), f"{what}.global_offset")
    shape = _ints(_field(m, "local_shape", None, what), f"{what}.local_shape")
    gshape = _ints(_field(m, "global_shape", None, what), f"{what}.global_shape", allow_none=True)
    dtype = _dtype(_field(m, "dtype", None, what), what)
    flat = _ints(
        _field(m, "flattened_range", None, what), f"{what}.flattened_range", allow_none=True
    )
    if not _field(m, "is_flattened", False, what):
        flat = None
    gshape = shape if gshape is None else gshape
    if not (len(offset) == len(shape) == len(gshape)):
        raise FormatError(
            f"{what}: global_offset {offset}, local_shape {shape} and global_shape {gshape} have "
            f"different numbers of dims"
        )
    if any(o + s > g for o, s, g in zip(offset, shape, gshape, strict=True)):
        raise FormatError(
            f"{what}: block at {offset} of shape {shape} reaches past the global shape {gshape}"
        )
    if flat is not None and (len(flat) != 2 or flat[0] > flat[1] or flat[1] > math.prod(shape)):
        raise FormatError(
            f"{what}: flattened_range {flat} does not lie in the {math.prod(shape)} elements of "
            f"its block {shape}"
        )
    return offset, shape, dtype, gshape, flat


def read_metadata(folder: str) -> FlexMetadata:
    """The stored pieces of the FlexCheckpoint folder `folder` (one `save_state_dict`)."""
    path = metadata_path(folder)
    md = safe_load_file(path, FLEX_POLICY)
    _of_class(md, "Metadata", path)
    sdm = _field(md, "state_dict_metadata", None, path)
    storage = _field(md, "storage_metadata", None, path)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise FormatError(
            f"{path}: state_dict_metadata and storage_metadata must be dicts, found "
            f"{type(sdm).__name__} and {type(storage).__name__}"
        )
    entries: dict[tuple, tuple] = {}  # (key, offset, flat) -> (shape, dtype, global shape)
    for key, metas in sdm.items():
        if not isinstance(key, str) or not isinstance(metas, (list, tuple)):
            raise FormatError(
                f"{path}: state_dict_metadata[{short_repr(key)}] is not a list of blocks"
            )
        for m in metas:
            offset, shape, dtype, gshape, flat = _entry(key, m, path)
            entries[(key, offset, flat)] = (shape, dtype, gshape)
    blocks: dict[str, dict[tuple, Block]] = {}
    files = set()
    for index, fname in storage.items():
        what = f"{path}: storage_metadata"
        _of_class(index, "LocalTensorIndex", what)
        key = _field(index, "tensor_key", None, what)
        if not isinstance(key, str):
            raise FormatError(f"{what}: tensor_key {short_repr(key)} is not a string")
        what = f"{what}[{key!r}]"
        if not isinstance(fname, str) or not DISTCP_RE.match(fname):
            raise FormatError(
                f"{what}: file {short_repr(fname)} is not a {{rank}}_{{id}}.distcp name"
            )
        replica = _field(index, "replica_id", None, what)
        if replica not in (None, 0):
            continue  # another copy of a block saved with save_replicas
        offset = _ints(_field(index, "global_offset", None, what), f"{what}.global_offset")
        flat = _ints(
            _field(index, "flattened_range", None, what), f"{what}.flattened_range", allow_none=True
        )
        if not _field(index, "is_flattened", False, what):
            flat = None
        found = entries.get((key, offset, flat))
        if found is None:
            raise FormatError(
                f"{what}: block at {offset} (flattened range {flat}) has no entry in "
                f"state_dict_metadata"
            )
        shape, dtype, gshape = found
        if flat is not None and flat[0] == flat[1]:
            continue  # an empty slice (stage3 ranks past the end of a parameter)
        file = os.path.join(folder, fname)
        files.add(file)
        b = Block(key, dtype, gshape, offset, shape, flat, file)
        blocks.setdefault(key, {})[(offset, flat)] = b
    missing = sorted(set(sdm) - set(blocks))
    if missing:
        empty = [k for k in missing if all(math.prod(_entry(k, m, path)[1]) == 0 for m in sdm[k])]
        missing = [k for k in missing if k not in empty]
    if missing:
        raise FormatError(f"{path}: no storage_metadata entry says where {missing[:5]} are stored")
    out = {k: tuple(v.values()) for k, v in blocks.items()}
    for k, bs in out.items():
        kinds = {(b.dtype, b.global_shape) for b in bs}
        if len(kinds) > 1:
            raise FormatError(
                f"{path}: blocks of {k!r} disagree on dtype / global shape: "
                f"{sorted((str(d), s) for d, s in kinds)}"
            )
    return FlexMetadata(path, out, tuple(sorted(files)))
