"""torch.distributed.checkpoint (DCP) `.metadata`, read without torch and checked.

Format (pytorch/pytorch: torch/distributed/checkpoint/metadata.py, filesystem.py):
- `.metadata` is one plain pickle of `Metadata(state_dict_metadata, planner_data, storage_data,
  storage_meta, version)`. Without collectives (`dcp.save(..., use_collectives=False)`) every
  rank writes `__{rank}.metadata` describing only its own chunks; they are merged here.
- `state_dict_metadata`: flattened fqn -> `TensorStorageMetadata(properties=TensorProperties(
  dtype, ...), size=<global torch.Size>, chunks=[ChunkStorageMetadata(offsets, sizes)])` or
  `BytesStorageMetadata()` (any pickled Python value). `TensorProperties` pickles as the tuple
  `(dtype, layout, requires_grad, _MEM_FORMAT_ENCODING, pin_memory)` (a dict in older torch).
- `storage_data`: `MetadataIndex(fqn, offset=<chunk offsets or None>)` -> `_StorageInfo(
  relative_path, offset, length[, transform_descriptors])`: the chunk's bytes are
  `[offset, offset + length)` of `<folder>/<relative_path>`.
- `planner_data`: fqn -> the original nested key path (e.g. `('optim', 'state', fqn, 'exp_avg')`).
- `storage_meta.checkpoint_id`: the absolute path it was written to (ignored: files are looked
  up next to the `.metadata`, so a moved checkpoint loads).

Rules checked: every tensor's chunks lie inside its global shape and tile it exactly (an overlap
or a gap is a FormatError naming the fqn, the chunk offsets and the file); every chunk has a
storage entry with a relative path inside the folder; no stream transforms. The pickle is read
by the restricted unpickler: the DCP classes become inert stubs and are copied into the frozen
dataclasses below.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from hybridckpt.containers.pickle.allow import Policy, Stub
from hybridckpt.containers.pickle.machine import safe_load_file
from hybridckpt.containers.pickle.torch_policy import TORCH_POLICY, TorchDtype
from hybridckpt.errors import FormatError
from hybridckpt.io.paths import inside

METADATA = ".metadata"

# DCP classes across torch versions (older torch kept some under torch.distributed._shard)
DCP_POLICY = TORCH_POLICY.merged(
    Policy(stub_prefixes=("torch.distributed.checkpoint.", "torch.distributed._shard."))
)


@dataclass(frozen=True)
class Chunk:
    """One saved block of a global tensor: `offsets`, `sizes` (elements per dim) and where its
    bytes are: `[offset, offset + length)` of `path` (absolute)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorEntry:
    """A global tensor: `fqn`, numpy `dtype`, global `shape`, the `chunks` that tile it."""

    fqn: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class BytesEntry:
    """A pickled Python value saved with `torch.save` at `[offset, offset + length)` of `path`."""

    fqn: str
    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    """A DCP checkpoint's metadata: tensors and byte items by flattened fqn.

    `folder` is where the data files are; `files` the metadata files read; `planner_data` fqn ->
    original key path (tuple of str/int) when the planner recorded it; `written_to` the path the
    checkpoint was saved at (informational)."""

    folder: str
    files: tuple[str, ...]
    tensors: Mapping[str, TensorEntry]
    bytes_items: Mapping[str, BytesEntry]
    planner_data: Mapping[str, tuple] = field(default_factory=dict)
    version: str | None = None
    written_to: str | None = None


# -- helpers ----------------------------------------------------------------------------------


def _attr(obj: Any, name: str, what: str):
    if isinstance(obj, Stub) and name in vars(obj):
        return vars(obj)[name]
    if isinstance(obj, Mapping) and name in obj:
        return obj[name]
    raise FormatError(f"{what}: expected a field '{name}' in {type(obj).__name__}")


def _kind(obj: Any) -> str:
    return type(obj).stub_name if isinstance(obj, Stub) else type(obj).__name__


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or not all(isinstance(i, int) and i >= 0 for i in x):
        raise FormatError(f"{what}: expected a tuple of non-negative ints, found {x!r}")
    return tuple(int(i) for i in x)


def _dtype(props: Any, what: str) -> np.dtype:
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


def _rel_path(folder: str, rel: Any, what: str) -> str:
    return inside(folder, rel, what, "storage path")


def _planner(data: Any) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    if isinstance(data, Mapping):
        for k, v in data.items():
            if isinstance(k, str) and isinstance(v, (tuple, list)):
                out[k] = tuple(v)
    return out


# -- tiling check -------------------------------------------------------------------------------


def check_tiling(fqn: str, shape: tuple[int, ...], chunks: Iterable[Chunk], where: str) -> None:
    """Chunks must lie inside `shape`, not overlap, and cover every element.

    Raises FormatError naming `fqn`, the offending chunk offsets and `where` (the file)."""
    chunks = list(chunks)
    nd = len(shape)
    for c in chunks:
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise FormatError(
                f"{where}: '{fqn}' chunk at offsets {c.offsets} has {len(c.sizes)} dims, the tensor {nd}"
            )
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True)):
            raise FormatError(
                f"{where}: '{fqn}' chunk at offsets {c.offsets} sizes {c.sizes} reaches past "
                f"the global shape {shape}"
            )
    live = [c for c in chunks if math.prod(c.sizes) > 0]
    if len(live) > 1:
        lo = np.array([c.offsets for c in live], dtype=np.int64).reshape(len(live), nd)
        hi = lo + np.array([c.sizes for c in live], dtype=np.int64).reshape(len(live), nd)
        block = 1024  # pairwise test in blocks: O(n^2) booleans, bounded memory
        for s in range(0, len(live), block):
            a_lo, a_hi = lo[s : s + block, None, :], hi[s : s + block, None, :]
            hit = np.all((a_lo < hi[None]) & (lo[None] < a_hi), axis=-1)
            idx = np.arange(s, min(s + block, len(live)))
            hit[np.arange(len(idx)), idx] = False
            if hit.any():
                i, j = np.argwhere(hit)[0]
                a, b = live[s + i], live[j]
                raise FormatError(
                    f"{where}: '{fqn}' chunks overlap: offsets {a.offsets} sizes {a.sizes} "
                    f"and offsets {b.offsets} sizes {b.sizes}"
                )
    covered = sum(math.prod(c.sizes) for c in live)
    total = math.prod(shape)
    if covered != total:
        raise FormatError(
            f"{where}: '{fqn}' chunks at offsets {[c.offsets for c in chunks]} cover {covered} "
            f"of {total} elements of shape {shape}: a gap"
        )


# -- reading ------------------------------------------------------------------------------------


def metadata_files(folder: str) -> list[str]:
    """`.metadata`, or the rank-local `__{rank}.metadata` files in rank order, or []."""
    glob = os.path.join(folder, METADATA)
    if os.path.isfile(glob):
        return [glob]
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    ranks = []
    for n in names:
        if n.startswith("__") and n.endswith(METADATA):
            r = n[2 : -len(METADATA)]
            if r.isdigit():
                ranks.append((int(r), os.path.join(folder, n)))
    return [p for _, p in sorted(ranks)]


def _parse_one(path: str, folder: str):
    md = safe_load_file(path, DCP_POLICY)
    # megatron-core 0.15 pickles its subclass `MCoreMetadata` (NVIDIA/Megatron-LM@core_v0.15.0:
    # megatron/core/dist_checkpointing/strategies/torch.py: Metadata plus `mcore_data`)
    if _kind(md) not in ("Metadata", "MCoreMetadata"):
        raise FormatError(f"{path}: expected a DCP Metadata pickle, found {_kind(md)}")
    sdm = _attr(md, "state_dict_metadata", path)
    storage = _attr(md, "storage_data", path) if "storage_data" in vars(md) else None
    if not isinstance(sdm, Mapping):
        raise FormatError(f"{path}: state_dict_metadata is {type(sdm).__name__}, not a dict")
    if not isinstance(storage, Mapping):
        raise FormatError(f"{path}: storage_data is {type(storage).__name__}, not a dict of chunks")
    # (fqn, offsets or None) -> (path, offset, length)
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for idx, info in storage.items():
        fqn = _attr(idx, "fqn", path)
        off = vars(idx).get("offset") if isinstance(idx, Stub) else None
        key_off = None if off is None else _ints(off, f"{path}: '{fqn}' offset")
        tds = vars(info).get("transform_descriptors") if isinstance(info, Stub) else None
        if tds:
            raise FormatError(
                f"{path}: '{fqn}' is stored with transforms {list(tds)!r}, which are not supported"
            )
        rel = _attr(info, "relative_path", path)
        offset, length = _attr(info, "offset", path), _attr(info, "length", path)
        if not (
            isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0
        ):
            raise FormatError(f"{path}: '{fqn}' storage offset/length {offset!r}/{length!r}")
        where[(fqn, key_off)] = (_rel_path(folder, rel, f"{path}: '{fqn}'"), offset, length)
    tensors: dict[str, tuple[np.dtype, tuple[int, ...], list[Chunk]]] = {}
    items: dict[str, BytesEntry] = {}
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise FormatError(f"{path}: state_dict_metadata key {fqn!r} is not a string")
        kind = _kind(entry)
        what = f"{path}: '{fqn}'"
        if kind == "BytesStorageMetadata":
            loc = where.get((fqn, None))
            if loc is None:
                raise FormatError(f"{what}: byte item has no storage entry")
            items[fqn] = BytesEntry(fqn, *loc)
        elif kind == "TensorStorageMetadata":
            dtype = _dtype(_attr(entry, "properties", what), what)
            shape = _ints(_attr(entry, "size", what), f"{what} size")
            chunks = []
            for c in _attr(entry, "chunks", what):
                offs = _ints(_attr(c, "offsets", what), f"{what} chunk offsets")
                sizes = _ints(_attr(c, "sizes", what), f"{what} chunk sizes")
                loc = where.get((fqn, offs))
                if loc is None:
                    raise FormatError(f"{what}: chunk at offsets {offs} has no storage entry")
                chunks.append(Chunk(offs, sizes, *loc))
            tensors[fqn] = (dtype, shape, chunks)
        else:
            raise FormatError(f"{what}: unknown storage metadata {kind}")
    version = vars(md).get("version")
    sm = vars(md).get("storage_meta")
    written = vars(sm).get("checkpoint_id") if isinstance(sm, Stub) else None
    return tensors, items, _planner(vars(md).get("planner_data")), version, written


def read_metadata(folder: str) -> DcpMetadata:
    """Parse and check the DCP metadata of `folder` (global `.metadata` or rank-local ones)."""
    folder = os.path.abspath(folder)
    files = metadata_files(folder)
    if not files:
        raise FormatError(
            f"{folder}: no {METADATA} or __<rank>{METADATA} file: not a DCP checkpoint"
        )
    tensors: dict[str, tuple[np.dtype, tuple[int, ...], list[Chunk]]] = {}
    origin: dict[str, str] = {}
    items: dict[str, BytesEntry] = {}
    planner: dict[str, tuple] = {}
    version = written = None
    for f in files:
        t, b, p, v, w = _parse_one(f, folder)
        version, written = version or v, written or w
        planner.update(p)
        for k, e in b.items():
            items.setdefault(k, e)
        for fqn, (dtype, shape, chunks) in t.items():
            if fqn not in tensors:
                tensors[fqn] = (dtype, shape, list(chunks))
                origin[fqn] = f
                continue
            dt0, sh0, have = tensors[fqn]
            if (dt0, sh0) != (dtype, shape):
                raise FormatError(
                    f"{f}: '{fqn}' is {dtype} {shape} here but {dt0} {sh0} in {origin[fqn]}"
                )
            seen = {(c.offsets, c.sizes) for c in have}
            # rank-local files: replicated tensors are written by every rank; keep one copy
            have.extend(c for c in chunks if (c.offsets, c.sizes) not in seen)
    where = files[0] if len(files) == 1 else f"{folder} (rank-local metadata)"
    out: dict[str, TensorEntry] = {}
    for fqn, (dtype, shape, chunks) in tensors.items():
        check_tiling(fqn, shape, chunks, origin.get(fqn, where) if len(files) == 1 else where)
        out[fqn] = TensorEntry(fqn, dtype, shape, tuple(chunks))
    return DcpMetadata(
        folder,
        tuple(files),
        MappingProxyType(out),
        MappingProxyType(items),
        MappingProxyType(planner),
        None if version is None else str(version),
        None if written is None else str(written),
    )
