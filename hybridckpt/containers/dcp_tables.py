"""DCP chunk metadata as columns: no Python object per chunk.

A DCP `.metadata` of a run on hundreds of ranks lists millions of chunks (Llama 3.1 405B with
AdamW moments on 256 ranks: 873k). Both readers of the pickle (the specialised one,
`containers.dcp_fast`, and the general machine, `containers.dcp_metadata`) fill a `RawTables`
(`array` columns, 8 bytes a number) and `assemble` turns it into one `ChunkTable` (numpy columns,
one row per chunk, a tensor's chunks in consecutive rows) with every number checked:

- `ChunkTable.offsets` / `sizes`: int64 `[chunks, width]`, element offsets and extents per dim;
  `width` is the largest ndim of the checkpoint; a tensor of fewer dims has offsets 0 and
  extents 1 in the dims past its own (so extents multiply to the chunk's elements);
- `file` int32 `[chunks]` (index into `files`, absolute paths checked inside the folder),
  `start` / `length` int64 `[chunks]`: the chunk's bytes are `[start, start + length)` of its
  file.

Storage entries (`MetadataIndex(fqn, offset) -> _StorageInfo`) are joined to chunks by
`(fqn, offsets)` with sorted columns (a later duplicate key wins, as in the dict torch builds);
a chunk with no storage entry is a FormatError naming the tensor, its offsets and the file.
Every tensor's chunks must tile it (`tiling`): inside the shape, no overlap, no gap.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import numpy as np

from hybridckpt.containers.box_tiling import check_boxes
from hybridckpt.errors import FormatError
from hybridckpt.io.paths import inside

MAX_DIMS = 64  # dims a chunk may have (torch allows 64)


@dataclass(frozen=True, eq=False)
class ChunkTable:
    """Every chunk of a checkpoint's tensors, one row each (see the module doc)."""

    offsets: np.ndarray
    sizes: np.ndarray
    file: np.ndarray
    start: np.ndarray
    length: np.ndarray
    files: tuple[str, ...]

    @property
    def rows(self) -> int:
        return len(self.file)

    def used_files(self) -> list[int]:
        """Indices into `files` of the files some chunk is in (a storage entry no chunk uses
        may name others)."""
        seen = np.zeros(len(self.files), dtype=bool)
        seen[self.file] = True
        return np.flatnonzero(seen).tolist()

    @property
    def nbytes(self) -> int:
        """Memory the columns take (bytes)."""
        return sum(a.nbytes for a in (self.offsets, self.sizes, self.file, self.start, self.length))


@dataclass
class RawTables:
    """What a reader of one `.metadata` pickle found, in flat columns (`array`s of C numbers).

    Strings (fqns, relative paths) are ids into `strings`. Chunks: `c_nd` dims per row and
    `c_coords` its offsets then its sizes; tensors: `(fqn id, numpy dtype, shape, first chunk
    row, chunk count)`. Storage entries: `s_fqn`, `s_nd` (-1: no offsets, a byte item),
    `s_coords` (offsets), `s_path` (relative path id, unchecked), `s_off`, `s_len`."""

    strings: list = field(default_factory=list)
    string_ids: dict = field(default_factory=dict)
    c_nd: array = field(default_factory=lambda: array("b"))
    c_coords: array = field(default_factory=lambda: array("q"))
    tensors: list = field(default_factory=list)
    s_fqn: array = field(default_factory=lambda: array("i"))
    s_nd: array = field(default_factory=lambda: array("b"))
    s_coords: array = field(default_factory=lambda: array("q"))
    s_path: array = field(default_factory=lambda: array("i"))
    s_off: array = field(default_factory=lambda: array("q"))
    s_len: array = field(default_factory=lambda: array("q"))
    budget: int = 1 << 62  # chunk numbers (dims and coordinates) the file may make: `numbers_budget`

    def string_id(self, s: str) -> int:
        i = self.string_ids.get(s)
        if i is None:
            i = self.string_ids[s] = len(self.strings)
            self.strings.append(s)
        return i

    def add_chunk(self, offsets, sizes) -> None:
        self.c_nd.append(len(offsets))
        self.c_coords.extend(offsets)
        self.c_coords.extend(sizes)

    def add_storage(self, fqn: str, offsets, path: str, off: int, length: int) -> None:
        self.s_fqn.append(self.string_id(fqn))
        if offsets is None:
            self.s_nd.append(-1)
        else:
            self.s_nd.append(len(offsets))
            self.s_coords.extend(offsets)
        self.s_path.append(self.string_id(path))
        self.s_off.append(off)
        self.s_len.append(length)


def numbers_budget(file_bytes: int) -> int:
    """Chunk numbers (a row's dims count plus its offsets and sizes) a `.metadata` of
    `file_bytes` bytes may make: 8 a byte, plus 1 Mi. A chunk pickled in full costs at least 2
    bytes a number; a memo fetch of one chunk object (2 bytes) would make 1 + 2 x 64 numbers, so
    a list of fetches of one 64-dim chunk is refused here, before its rows take memory."""
    return (1 << 20) + 8 * file_bytes


def _padded(nd: np.ndarray, coords: np.ndarray, per_row: int, width: int) -> tuple[np.ndarray, ...]:
    """Rows of `per_row` groups of `nd[i]` numbers each (flat in `coords`) as `per_row` arrays
    `[rows, width]`, padded with 0."""
    rows = len(nd)
    starts = np.zeros(rows, dtype=np.int64)
    if rows:
        np.cumsum(nd.astype(np.int64) * per_row, out=starts)
        starts -= nd.astype(np.int64) * per_row
    out = []
    for g in range(per_row):
        a = np.zeros((rows, width), dtype=np.int64)
        for d in range(width):
            has = nd > d
            a[has, d] = coords[starts[has] + g * nd[has] + d]
        out.append(a)
    return tuple(out)


@dataclass(frozen=True)
class Assembled:
    """`assemble`'s result: the table, each tensor's `(fqn, dtype, shape, first, count)`, and
    each byte item's `fqn -> (path, offset, length)`."""

    table: ChunkTable
    tensors: list
    items: dict


def assemble(raw: RawTables, folder: str, where: str, *, tile: bool = True) -> Assembled:
    """Join `raw`'s chunks to their storage entries and check every number (module doc).

    `folder` holds the data files; `where` (the metadata file) is named in every error; `tile`:
    check that each tensor's chunks tile it (not for one rank's part of rank-local metadata)."""
    nd = np.frombuffer(raw.c_nd, dtype=np.int8).astype(np.int64)
    if len(nd) and (nd.min() < 0 or nd.max() > MAX_DIMS):
        raise FormatError(f"{where}: a chunk has {int(nd.max())} dims (at most {MAX_DIMS})")
    width = max([int(nd.max()) if len(nd) else 0] + [len(t[2]) for t in raw.tensors] + [1])
    if len(nd) * width > max(1 << 22, 4 * (len(raw.c_coords) + len(nd))):
        raise FormatError(
            f"{where}: {len(nd)} chunks padded to {width} dims would take {len(nd) * width * 16} bytes "
            f"for {len(raw.c_coords)} numbers: refused (a few chunks of many dims among many of few)"
        )
    coords = np.frombuffer(raw.c_coords, dtype=np.int64)
    offsets, sizes = _padded(nd, coords, 2, width)
    # per-row tensor index and shape
    n_rows = len(nd)
    owner = np.full(n_rows, -1, dtype=np.int64)
    shapes = np.ones((len(raw.tensors), width), dtype=np.int64)
    t_nd = np.zeros(len(raw.tensors), dtype=np.int64)
    fqn_of = np.zeros(len(raw.tensors), dtype=np.int64)
    for i, (fqn, _dt, shape, first, count) in enumerate(raw.tensors):
        if first < 0 or count < 0 or first + count > n_rows or (owner[first : first + count] != -1).any():
            raise FormatError(f"{where}: '{fqn}' chunk rows [{first}, {first + count}) are not its own")
        owner[first : first + count] = i
        shapes[i, : len(shape)] = shape
        t_nd[i] = len(shape)
        fqn_of[i] = raw.string_id(fqn)
    for d in range(width):  # padding past a chunk's own dims: offset 0, extent 1
        pad = nd <= d
        sizes[pad, d] = 1
    if (owner < 0).any():
        raise FormatError(f"{where}: chunk row {int(np.argmax(owner < 0))} belongs to no tensor")
    # dims and bounds, every row at once
    row_shape = shapes[owner] if n_rows else np.zeros((0, width), dtype=np.int64)
    bad = np.flatnonzero(nd != t_nd[owner]) if n_rows else []
    if len(bad):
        r = int(bad[0])
        raise FormatError(
            f"{where}: '{raw.tensors[owner[r]][0]}' chunk at offsets {_tup(offsets[r], nd[r])} has "
            f"{nd[r]} dims, the tensor {t_nd[owner[r]]}"
        )
    over = np.flatnonzero(((offsets < 0) | (sizes < 0) | (offsets + sizes > row_shape)).any(axis=1))
    if len(over):
        r = int(over[0])
        raise FormatError(
            f"{where}: '{raw.tensors[owner[r]][0]}' chunk at offsets {_tup(offsets[r], nd[r])} sizes "
            f"{_tup(sizes[r], nd[r])} reaches past the global shape {raw.tensors[owner[r]][2]}"
        )
    file, start, length, items, files = _join(raw, offsets, nd, fqn_of[owner] if n_rows else owner, owner,
                                             folder, where, width)
    table = ChunkTable(offsets, sizes, file, start, length, files)
    if tile:
        tiling(table, raw.tensors, where)
    return Assembled(table, raw.tensors, items)


def _tup(row: np.ndarray, n) -> tuple[int, ...]:
    return tuple(int(x) for x in row[: int(n)])


def _join(raw, offsets, nd, row_fqn, owner, folder, where, width):
    """For each chunk row, its storage entry's file, start and length (module doc)."""
    s_nd = np.frombuffer(raw.s_nd, dtype=np.int8).astype(np.int64)
    s_fqn = np.frombuffer(raw.s_fqn, dtype=np.int32).astype(np.int64)
    s_path = np.frombuffer(raw.s_path, dtype=np.int32).astype(np.int64)
    s_off = np.frombuffer(raw.s_off, dtype=np.int64)
    s_len = np.frombuffer(raw.s_len, dtype=np.int64)
    if len(s_nd) and (s_nd.max() > MAX_DIMS or (s_off < 0).any() or (s_len < 0).any()):
        raise FormatError(f"{where}: a storage entry has a negative offset or length, or too many dims")
    # relative paths: each distinct one checked once, then numbered
    paths: dict[int, int] = {}
    files: list[str] = []
    pids, first_use = np.unique(s_path, return_index=True)
    for pid, i in zip(pids.tolist(), first_use.tolist(), strict=True):
        paths[pid] = len(files)
        files.append(inside(folder, raw.strings[pid], f"{where}: '{raw.strings[s_fqn[i]]}'", "storage path"))
    file_of = np.array([paths.get(i, -1) for i in range(len(raw.strings))], dtype=np.int32)
    # byte items: entries without offsets (the last one of a fqn wins)
    items: dict[str, tuple[str, int, int]] = {}
    for i in np.flatnonzero(s_nd < 0).tolist():
        items[raw.strings[s_fqn[i]]] = (files[file_of[s_path[i]]], int(s_off[i]), int(s_len[i]))
    # tensor entries: keys (fqn, nd, offsets...) sorted, the last duplicate kept
    has = np.flatnonzero(s_nd >= 0)
    sw = max(width, int(s_nd.max()) if len(s_nd) else 0)
    s_offsets = _padded(s_nd[has], np.frombuffer(raw.s_coords, dtype=np.int64), 1, sw)[0] if len(has) else np.zeros((0, sw), np.int64)
    if sw > width:  # entries with more dims than any chunk: they match no chunk
        offsets = np.concatenate([offsets, np.zeros((len(offsets), sw - width), np.int64)], axis=1)
    s_keys = np.concatenate([s_fqn[has, None], s_nd[has, None], s_offsets], axis=1)
    c_keys = np.concatenate([row_fqn[:, None], nd[:, None], offsets], axis=1)
    order = np.lexsort(s_keys.T[::-1])
    s_sorted = s_keys[order]
    if len(order) > 1:  # keep the last of equal keys (lexsort is stable: the last is the later one)
        last = np.ones(len(order), dtype=bool)
        last[:-1] = (s_sorted[1:] != s_sorted[:-1]).any(axis=1)
        order, s_sorted = order[last], s_sorted[last]
    found = _lookup(s_sorted, c_keys)
    missing = np.flatnonzero(found < 0)
    if len(missing):
        r = int(missing[0])
        raise FormatError(
            f"{where}: '{raw.tensors[owner[r]][0]}': chunk at offsets {_tup(offsets[r], nd[r])} has no "
            f"storage entry"
        )
    entry = has[order[found]]
    return file_of[s_path[entry]], s_off[entry].copy(), s_len[entry].copy(), items, tuple(files)


def _lookup(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Row of `sorted_keys` (lexicographically sorted, unique) equal to each row of `keys`, or -1."""
    n, m = len(sorted_keys), len(keys)
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    if n == 0:
        return np.full(m, -1, dtype=np.int64)
    both = np.concatenate([sorted_keys, keys])
    tag = np.concatenate([np.zeros(n, np.int64), np.ones(m, np.int64)])  # entries sort first
    order = np.lexsort(np.concatenate([tag[None], both.T[::-1]]))
    is_entry = order < n
    pos = np.where(is_entry, order, -1)
    last_entry = np.maximum.accumulate(pos)  # the entry at or before each sorted position
    out = np.full(m, -1, dtype=np.int64)
    q = ~is_entry
    cand = last_entry[q]
    who = order[q] - n
    ok = cand >= 0
    ok[ok] = (sorted_keys[cand[ok]] == keys[who[ok]]).all(axis=1)
    out[who[ok]] = cand[ok]
    return out


# -- tiling -----------------------------------------------------------------------------------

def tiling(table: ChunkTable, tensors: list, where: str) -> None:
    """Every tensor's chunks lie inside it (checked by `assemble`), do not overlap and cover it.

    The common case, every dim but the first whole in every chunk, is checked for all tensors at
    once (sorted starts, each chunk ending where the next begins); the rest per tensor by
    `box_tiling.check_boxes` (O(n log n) or bounded, never pair by pair)."""
    if not tensors:
        return
    width = table.offsets.shape[1]
    shapes = np.ones((len(tensors), width), dtype=np.int64)
    counts = np.zeros(len(tensors), dtype=np.int64)
    firsts = np.zeros(len(tensors), dtype=np.int64)
    for i, (_f, _d, shape, first, count) in enumerate(tensors):
        shapes[i, : len(shape)] = shape
        firsts[i], counts[i] = first, count
    owner = np.repeat(np.arange(len(tensors)), counts)
    rows = np.concatenate([np.arange(f, f + c) for f, c in zip(firsts, counts, strict=True)]) if len(owner) else owner
    off, size = table.offsets[rows], table.sizes[rows]
    live = size.prod(axis=1) > 0
    whole = (off[:, 1:] == 0).all(axis=1) & (size[:, 1:] == shapes[owner, 1:]).all(axis=1)
    simple = np.ones(len(tensors), dtype=bool)
    np.logical_and.at(simple, owner, whole | ~live)
    sel = np.flatnonzero(live & simple[owner])
    if len(sel):
        o = np.lexsort((off[sel, 0], owner[sel]))
        t, a, b = owner[sel][o], off[sel, 0][o], off[sel, 0][o] + size[sel, 0][o]
        first = np.ones(len(t), dtype=bool)
        first[1:] = t[1:] != t[:-1]
        lastv = np.ones(len(t), dtype=bool)
        lastv[:-1] = t[1:] != t[:-1]
        ok = np.where(first, a == 0, a == np.roll(b, 1))
        ok &= np.where(lastv, b == shapes[t, 0], True)
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            _tile_error(tensors[t[k]], table, where)
    covered = np.zeros(len(tensors), dtype=bool)
    covered[owner[sel]] = True
    for i in np.flatnonzero(simple & ~covered).tolist():  # no live chunk: only 0-element tensors pass
        if math.prod(tensors[i][2]) != 0:
            _tile_error(tensors[i], table, where)
    for i in np.flatnonzero(~simple).tolist():
        f, c = int(firsts[i]), int(counts[i])
        check_boxes(tensors[i][0], tensors[i][2], table.offsets[f : f + c], table.sizes[f : f + c], where)


def _tile_error(t, table: ChunkTable, where: str) -> None:
    fqn, _d, shape, first, count = t
    check_boxes(fqn, shape, table.offsets[first : first + count], table.sizes[first : first + count], where)
    raise FormatError(f"{where}: '{fqn}' chunks do not tile its shape {shape}")  # not reached
