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
storage entry with a relative path inside the folder; no stream transforms.

Reading (millions of chunks on runs of hundreds of ranks): the pickle is read by the specialised
reader of this one shape (`containers.dcp_fast`), or, for anything it does not know, by the
restricted unpickler (DCP classes as inert stubs, `containers.dcp_stubs`); both fill the same
columns, checked and joined once (`containers.dcp_tables`): a `ChunkTable` of numpy arrays, one
row per chunk. A `TensorEntry` is a range of its rows; `entry.chunks` builds `Chunk` objects only
when asked (one tensor at a time).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from hybridckpt.containers import dcp_fast
from hybridckpt.containers.dcp_stubs import DCP_POLICY, extract
from hybridckpt.containers.dcp_tables import (
    ChunkTable,
    RawTables,
    assemble,
    check_boxes,
    numbers_budget,
    tiling,
)
from hybridckpt.containers.pickle.machine import safe_load_file
from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import ByteSource

METADATA = ".metadata"

__all__ = [
    "DCP_POLICY",
    "METADATA",
    "BytesEntry",
    "Chunk",
    "ChunkTable",
    "DcpMetadata",
    "TensorEntry",
    "check_tiling",
    "metadata_files",
    "read_metadata",
]


@dataclass(frozen=True)
class Chunk:
    """One saved block of a global tensor: `offsets`, `sizes` (elements per dim) and where its
    bytes are: `[offset, offset + length)` of `path` (absolute)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: str
    offset: int
    length: int


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """A global tensor: `fqn`, numpy `dtype`, global `shape`, and its chunks: rows
    `[first, first + count)` of `table` (which tile it)."""

    fqn: str
    dtype: np.dtype
    shape: tuple[int, ...]
    table: ChunkTable
    first: int
    count: int

    @property
    def rows(self) -> slice:
        return slice(self.first, self.first + self.count)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The chunks as objects (built on each call: for one tensor at a time)."""
        t, nd = self.table, len(self.shape)
        r = self.rows
        return tuple(
            Chunk(tuple(o[:nd]), tuple(z[:nd]), t.files[f], s, n)
            for o, z, f, s, n in zip(
                t.offsets[r].tolist(), t.sizes[r].tolist(), t.file[r].tolist(),
                t.start[r].tolist(), t.length[r].tolist(), strict=True,
            )
        )

    def files(self) -> set[str]:
        """The data files its chunks are in."""
        return {self.table.files[i] for i in np.unique(self.table.file[self.rows]).tolist()}


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

    `folder` is where the data files are; `files` the metadata files read; `table` every chunk
    of every tensor (`containers.dcp_tables.ChunkTable`); `planner_data` fqn -> original key path
    (tuple of str/int) when the planner recorded it; `written_to` the path the checkpoint was
    saved at (informational); `readers` which reader read each metadata file ("fast": the
    specialised one, "general": the restricted unpickler)."""

    folder: str
    files: tuple[str, ...]
    tensors: Mapping[str, TensorEntry]
    bytes_items: Mapping[str, BytesEntry]
    planner_data: Mapping[str, tuple] = field(default_factory=dict)
    version: str | None = None
    written_to: str | None = None
    table: ChunkTable | None = None
    readers: tuple[str, ...] = ()


# -- tiling check -------------------------------------------------------------------------------


def check_tiling(fqn: str, shape: tuple[int, ...], chunks: Iterable[Chunk], where: str) -> None:
    """Chunks must have the tensor's dims, lie inside `shape`, not overlap, and cover every element.

    Raises FormatError naming `fqn`, the offending chunk offsets and `where` (the file)."""
    chunks = list(chunks)
    nd = len(shape)
    for c in chunks:
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise FormatError(
                f"{where}: '{fqn}' chunk at offsets {c.offsets} has {len(c.sizes)} dims, the tensor {nd}"
            )
    w = max(nd, 1)
    offs = np.zeros((len(chunks), w), dtype=np.int64)
    sizes = np.ones((len(chunks), w), dtype=np.int64)
    if nd and chunks:
        offs[:, :nd] = [c.offsets for c in chunks]
        sizes[:, :nd] = [c.sizes for c in chunks]
    check_boxes(fqn, tuple(shape), offs, sizes, where)


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


@dataclass(frozen=True)
class _One:
    """One metadata file read: its chunks' table, tensors `(fqn, dtype, shape, first, count)`,
    byte items, planner data, version, written-to path, and which reader read it."""

    table: ChunkTable
    tensors: list
    items: dict
    planner: dict
    version: object
    written: object
    reader: str


def _parse_one(path: str, folder: str, tile: bool) -> _One:
    src = ByteSource(path)
    data = bytearray(src.size())
    src.read_into(0, memoryview(data))
    try:
        raw, rest = dcp_fast.read(data, path)
        reader = "fast"
    except dcp_fast.Fallback:
        del data
        raw = RawTables(budget=numbers_budget(src.size()))
        rest = extract(safe_load_file(path, DCP_POLICY), raw, path)
        reader = "general"
    else:
        del data
    byte_fqns, planner, version, written = rest
    got = assemble(raw, folder, path, tile=tile)
    items = {}
    for fqn in byte_fqns:
        loc = got.items.get(fqn)
        if loc is None:
            raise FormatError(f"{path}: '{fqn}': byte item has no storage entry")
        items[fqn] = BytesEntry(fqn, *loc)
    return _One(got.table, got.tensors, items, planner, version, written, reader)


def read_metadata(folder: str) -> DcpMetadata:
    """Parse and check the DCP metadata of `folder` (global `.metadata` or rank-local ones)."""
    folder = os.path.abspath(folder)
    files = metadata_files(folder)
    if not files:
        raise FormatError(
            f"{folder}: no {METADATA} or __<rank>{METADATA} file: not a DCP checkpoint"
        )
    parts = [_parse_one(f, folder, len(files) == 1) for f in files]
    version = next((p.version for p in parts if p.version), None)
    written = next((p.written for p in parts if p.written), None)
    planner: dict[str, tuple] = {}
    items: dict[str, BytesEntry] = {}
    for p in parts:
        planner.update(p.planner)
        for k, e in p.items.items():
            items.setdefault(k, e)
    table, tensors = (parts[0].table, parts[0].tensors) if len(parts) == 1 else _merge(parts, files, folder)
    out = {
        fqn: TensorEntry(fqn, dt, tuple(shape), table, first, count)
        for fqn, dt, shape, first, count in tensors
    }
    return DcpMetadata(
        folder,
        tuple(files),
        MappingProxyType(out),
        MappingProxyType(items),
        MappingProxyType(planner),
        None if version is None else str(version),
        None if written is None else str(written),
        table,
        tuple(p.reader for p in parts),
    )


def _merge(parts: list[_One], files: list[str], folder: str) -> tuple[ChunkTable, list]:
    """Rank-local metadata files merged: a tensor's chunks from every file (replicated tensors
    are written by every rank: one copy of each `(offsets, sizes)` kept), dtype and shape
    agreeing; then the tiling checked again."""
    paths: dict[str, int] = {}
    order: list[str] = []
    seen: dict[str, tuple] = {}  # fqn -> (dtype, shape, origin file)
    rows: dict[str, list] = {}  # fqn -> [(part, row)]
    for p, f in zip(parts, files, strict=True):
        for fqn, dt, shape, first, count in p.tensors:
            if fqn not in seen:
                seen[fqn] = (dt, shape, f)
                order.append(fqn)
                rows[fqn] = []
            elif (seen[fqn][0], seen[fqn][1]) != (dt, shape):
                raise FormatError(
                    f"{f}: '{fqn}' is {dt} {shape} here but {seen[fqn][0]} {seen[fqn][1]} in {seen[fqn][2]}"
                )
            rows[fqn] += [(p, r) for r in range(first, first + count)]
        for name in p.table.files:
            paths.setdefault(name, len(paths))
    cols: dict[str, list] = {k: [] for k in ("offsets", "sizes", "file", "start", "length")}
    width = max([p.table.offsets.shape[1] for p in parts] + [1])
    tensors = []
    n = 0
    for fqn in order:
        dt, shape, _ = seen[fqn]
        kept = set()
        first = n
        for p, r in rows[fqn]:
            t = p.table
            key = (tuple(t.offsets[r, : len(shape)].tolist()), tuple(t.sizes[r, : len(shape)].tolist()))
            if key in kept:
                continue
            kept.add(key)
            o = np.zeros(width, np.int64)
            z = np.ones(width, np.int64)
            o[: t.offsets.shape[1]], z[: t.sizes.shape[1]] = t.offsets[r], t.sizes[r]
            cols["offsets"].append(o)
            cols["sizes"].append(z)
            cols["file"].append(paths[t.files[t.file[r]]])
            cols["start"].append(t.start[r])
            cols["length"].append(t.length[r])
            n += 1
        tensors.append((fqn, dt, shape, first, n - first))
    table = ChunkTable(
        np.array(cols["offsets"], np.int64).reshape(n, width),
        np.array(cols["sizes"], np.int64).reshape(n, width),
        np.array(cols["file"], np.int32),
        np.array(cols["start"], np.int64),
        np.array(cols["length"], np.int64),
        tuple(paths),
    )
    tiling(table, tensors, f"{folder} (rank-local metadata)")
    return table, tensors
