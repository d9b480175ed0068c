"""Arrays of an Orbax checkpoint as LazyTensors: a box read reads only the chunks covering it.

Layout read (see `hybridckpt.store.layout`): `DIR/<step>/<item>/` is one Orbax pytree item
(`params`, `opt_state`) in OCDBT format or, for a raw import, a folder per array
(`containers.orbax.chunk_files`); its `_METADATA` names every leaf (the dotted key path,
e.g. `layers.q.kernel`, `0.mu.layers.q.kernel`) and says whether arrays are zarr v2 or v3. Each
array is a zarr array at that name inside the item's OCDBT database, opened with the read spec
Orbax builds, written on TensorStore's public API (`containers.orbax.ts_spec`), so a box read
fetches and decompresses only the chunks it overlaps (a stacked `[layers, ...]` leaf saved by
`hybridckpt import` is chunked per layer: one layer read = one layer's chunks).

This is how every job reads our store (`formats.orbax_store`): `export` streams: one HF tensor in memory at a time,
instead of restoring the whole tree onto one device.

Raw chunks: where an array is stored uncompressed (zarr v2 `compressor: null`, no filters, C order,
little-endian; `hybridckpt import`'s default, see `containers.orbax.codec`) and every chunk lies in a data
file (`containers.orbax.chunk_index`, the OCDBT index, which also holds each `.zarray` and the chunks of up to
1024 bytes), the array is its chunks as `StoredTensor`s tiled at their grid offsets (zarr v2 stores edge chunks whole, padded):
a box read is one pread per contiguous run straight into the caller's buffer (no TensorStore, no
cache, no copy), counted by `io.byte_source.count_reads`, and `file_runs` gives an export the
byte ranges to copy file to file (`lazy.copy_runs`). Such an item is read with tensorstore's
OCDBT index alone: neither JAX nor Orbax is imported. Anything else (compressed or missing
chunks, zarr v3) reads through TensorStore as Orbax would; from a bucket (an item in a view of
`io.remote.view`) TensorStore reads the objects themselves (`containers.orbax.ts_spec`), its
requests counted for the bucket's host (`io.remote.ts_kvstore.settle`).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from hybridckpt.containers.orbax import ts_spec
from hybridckpt.containers.orbax.chunk_index import (
    OCDBT_MANIFEST,
    ItemIndex,
    UnsafeItem,
    no_special_files,
    read_index,
)
from hybridckpt.containers.orbax.declared import check_item
from hybridckpt.containers.orbax.keys import metadata_leaf_names
from hybridckpt.errors import CheckpointError
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.io.config_file import read_json
from hybridckpt.io.direct_io import aligned_empty
from hybridckpt.io.page_advice import no_huge_pages
from hybridckpt.io.remote import ts_kvstore
from hybridckpt.lazy import ArrayTensor, Box, FileRun, LazyTensor, StoredTensor, tiled
from hybridckpt.lazy.box import block_overlap
from hybridckpt.lazy.tiled import Tiled


class _Item:
    """What the arrays of one opened item share: its OCDBT index (read once) and a TensorStore
    context (so a chunk cache per opened item: a later open sees what is on disk now)."""

    def __init__(self, item_dir: str):
        self.item_dir = item_dir
        self._lock = threading.Lock()
        self._index: list = []
        self._context: list = []

    def index(self) -> ItemIndex | None:
        """The OCDBT index, or None when it cannot be read (TensorStore then says what is wrong);
        an index that names a data file outside the item is an error here."""
        with self._lock:
            if not self._index:
                try:
                    self._index.append(read_index(self.item_dir))
                except UnsafeItem:
                    raise  # (TensorStore would follow the reference: it is not asked)
                except CheckpointError:
                    self._index.append(None)
            return self._index[0]

    @property
    def use_ocdbt(self) -> bool:
        """Whether the item is one OCDBT database (else a folder per array: `containers.orbax.chunk_files`)."""
        return os.path.isfile(os.path.join(self.item_dir, OCDBT_MANIFEST))

    def context(self):
        with self._lock:
            if not self._context:
                self._context.append(ts_spec.context(use_ocdbt=self.use_ocdbt))
            return self._context[0]


@dataclass(frozen=True, eq=False)
class OrbaxArray(LazyTensor):
    """Leaf `name` of the Orbax item at `item_dir`: global `shape` and `dtype` as saved."""

    item_dir: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    use_zarr3: bool = False
    item: _Item | None = field(default=None, repr=False)  # shared by the item's arrays
    _store: list = field(default_factory=list, repr=False)  # the opened TensorStore, once
    _raw: list = field(default_factory=list, repr=False)  # [its raw chunks as a Tiled, or None]

    def _open(self):
        if not self._store:
            import tensorstore as ts

            item = self.item or _Item(self.item_dir)
            context = item.context()
            spec = ts_spec.read_spec(self.item_dir, self.name, use_ocdbt=item.use_ocdbt, use_zarr3=self.use_zarr3)
            try:
                store = ts.open(ts.Spec(spec), open=True, context=context).result()
            except ValueError as e:
                raise CheckpointError(f"{self.item_dir}: cannot open array {self.name}: {_reason(e)}") from e
            finally:
                ts_kvstore.settle(self.item_dir)  # (in a bucket: TensorStore's GETs, counted for its host)
            self._store.append(store)
        return self._store[0]

    def raw(self) -> LazyTensor | None:
        """The array as its uncompressed stored chunks (see the module doc), or None."""
        if not self._raw:
            index = None if self.use_zarr3 or self.item is None else self.item.index()
            self._raw.append(None if index is None else raw_chunks(self.name, self.shape, index))
        return self._raw[0]

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        raw = self.raw()
        return None if raw is None else raw.file_runs(box, limit)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        raw = self.raw()
        if raw is None:
            super().read_into(box, out)
        else:
            raw.read_into(box, out)

    def read_box(self, box: Box) -> np.ndarray:
        raw = self.raw()
        if raw is not None:  # (aligned: a cold chunk file is read into it with O_DIRECT, `io.direct_read`)
            out = aligned_empty(tuple(b - a for a, b in box), self.dtype)
            no_huge_pages(out)  # (`io.page_advice`)
            raw.read_into(box, out)
            return out
        index = tuple(slice(a, b) for a, b in box)
        try:
            out = self._open()[index].read().result()
        except ValueError as e:
            raise CheckpointError(f"{self.item_dir}: cannot read {self.name}{list(box)}: {_reason(e)}") from e
        finally:
            ts_kvstore.settle(self.item_dir)
        out = np.asarray(out, dtype=self.dtype)
        return out if out.flags.c_contiguous else out.copy()  # (ascontiguousarray makes 0-d 1-d)


def zarr_dtype(text: str) -> np.dtype | None:
    """The numpy dtype of a zarr v2 dtype string ("<f4", "bfloat16", ...), or None."""
    import ml_dtypes

    try:
        return np.dtype(getattr(ml_dtypes, text)) if hasattr(ml_dtypes, str(text)) else np.dtype(text)
    except (TypeError, ValueError):
        return None


def raw_layout(zarray: dict) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype, str] | None:
    """(shape, chunk shape, dtype, key separator) of a zarr v2 array whose chunks are raw C-order
    little-endian bytes; None for any other (compressed, filtered, Fortran order, big-endian) and
    for metadata that is not such an object (TensorStore then reads it and says what is wrong)."""
    if not isinstance(zarray, dict):
        return None
    dtype = zarr_dtype(zarray.get("dtype", ""))
    if (dtype is None or zarray.get("compressor") is not None or zarray.get("filters")
            or zarray.get("order", "C") != "C" or dtype.byteorder == ">" or zarray.get("zarr_format", 2) != 2):
        return None
    try:
        shape = tuple(int(n) for n in zarray.get("shape", ()))
        chunks = tuple(int(c) for c in zarray.get("chunks", shape))
    except (TypeError, ValueError, OverflowError):
        return None
    sep = zarray.get("dimension_separator", ".")
    if len(chunks) != len(shape) or any(c <= 0 for c in chunks) or any(n < 0 for n in shape) or sep not in (".", "/"):
        return None
    return shape, chunks, dtype, sep


def raw_chunks(name: str, shape: tuple[int, ...], index: ItemIndex) -> LazyTensor | None:
    """Array `name` as its stored chunks (a `Tiled` of `StoredTensor`s, and in-memory pieces for
    chunks inline in the index), when it is raw and every chunk is stored at its full size; else
    None."""
    zarray = index.zarrays.get(name)
    layout = None if zarray is None else raw_layout(zarray)
    if layout is None or layout[0] != tuple(shape):
        return None
    _, chunk, dtype, sep = layout
    grid = math.prod(-(-n // c) for n, c in zip(shape, chunk, strict=True))
    if grid > len(index.locations) + len(index.inline):  # more chunks than stored: some are missing
        return None  # (and a declared grid is never walked past what the index holds)
    want = math.prod(chunk) * dtype.itemsize
    pieces = []
    for origin in itertools.product(*(range(0, n, c) for n, c in zip(shape, chunk, strict=True))):
        key = f"{name}/" + (sep.join(str(o // c) for o, c in zip(origin, chunk, strict=True)) or "0")
        loc, value = index.locations.get(key), index.inline.get(key)
        if loc is not None and loc.length == want:
            pieces.append((origin, StoredTensor(ByteSource(loc.path), loc.offset, chunk, dtype)))
        elif value is not None and len(value) == want:  # a small chunk kept in its B-tree node
            pieces.append((origin, ArrayTensor(np.frombuffer(value, dtype=dtype).reshape(chunk))))
        else:  # missing (the fill value) or not raw
            return None
    if len(pieces) == 1:
        return tiled(tuple(shape), dtype, pieces)  # (a single whole chunk is itself: 0-d arrays too)
    return ChunkGrid(tuple(shape), dtype, tuple(pieces), tuple(chunk))


@dataclass(frozen=True, eq=False)
class ChunkGrid(Tiled):
    """A `Tiled` whose pieces are a regular grid of `chunk`-shaped blocks in C order (a raw
    array's chunk files): a box reads the blocks it meets, found by their grid index, not by an
    overlap test of every block (a restore's read of one piece of a 72-chunk array tested all 72:
    63k tests in a 1.1 GB restore, issue 42)."""

    chunk: tuple[int, ...] = ()

    def read_into(self, box: Box, out: np.ndarray) -> None:
        if out.size == 0:
            return
        grid = [-(-n // c) for n, c in zip(self.shape, self.chunk, strict=True)]
        ranges = [range(max(0, a // c), min(g, -(-b // c))) for (a, b), c, g in zip(box, self.chunk, grid, strict=True)]
        for idx in itertools.product(*ranges):
            pos = 0
            for i, g in zip(idx, grid, strict=True):
                pos = pos * g + i
            offs, block = self.pieces[pos]
            sub = block_overlap(box, offs, block.shape)
            if sub is not None:
                dst = tuple(slice(o + s - a, o + e - a) for (s, e), o, (a, _) in zip(sub, offs, box, strict=True))
                block.read_into(sub, out[dst])

    def chunk_file(self, pos: int, shape: tuple[int, ...]) -> tuple[ByteSource, int] | None:
        """(file, byte offset) of the raw C-order bytes of the chunk at grid position `pos` (C
        order) when they are `shape` (its box in the array), or None: a chunk kept inline in the
        index, or an edge chunk stored padded to the full chunk shape (its rows are longer than
        the box's, so a run of the box is not a run of the file)."""
        block = self.pieces[pos][1]
        if not isinstance(block, StoredTensor) or tuple(block.shape) != tuple(shape):
            return None
        return block.source, block.offset


def scalar_int(t: LazyTensor, name: str, where: str) -> int:
    """The value of a step counter leaf (`step`, Adam's `count`): a CheckpointError unless it is
    one integer element (checked on its declared shape before anything is read)."""
    dtype = np.dtype(t.dtype)
    if math.prod(t.shape) != 1 or dtype.kind not in "iu":
        raise CheckpointError(f"{where}: {name} is {dtype.name} {list(t.shape)}, expected one integer (a step count)")
    return int(t.materialize().reshape(()))


def _reason(e: Exception) -> str:
    """TensorStore's error without the spec it appends (a JSON document of a few hundred bytes)."""
    text = str(e).split(" [source locations=")[0].split(" [tensorstore_spec=")[0]
    return " ".join(text.split())[:300]


@dataclass(frozen=True)
class UnreadableArray:
    """An array of the item whose metadata or index cannot be read (`item_arrays(...,
    unreadable="keep")`): its name and the reason, for a report that goes on."""

    name: str
    reason: str


def item_arrays(item_dir: str, *, unreadable: str = "raise") -> dict[str, OrbaxArray]:
    """Every array leaf of the Orbax item at `item_dir`, by its dotted name (from `_METADATA`
    for the names and zarr version, the zarr metadata for shape and dtype; no data read).

    unreadable: "raise" (a CheckpointError naming the array) or "keep" (an `UnreadableArray` in
    its place, for `verify` to report every damaged array rather than stop at the first).
    """
    meta_path = os.path.join(item_dir, "_METADATA")
    meta = read_json(meta_path)
    zarr3 = bool(meta.get("use_zarr3", False))
    leaves = metadata_leaf_names(meta, meta_path)  # names, never paths: one folder each, no two alike
    out: dict[str, OrbaxArray] = {}
    item = _Item(item_dir)
    no_special_files(item_dir)  # (TensorStore would wait on a FIFO named like a chunk)
    if not item.use_ocdbt:
        _one_folder_each(item_dir, leaves, meta_path)
    walked = item.index() if item.use_ocdbt or not zarr3 else None  # (an OCDBT index is walked, and its
    index = None if zarr3 else walked  # data files checked to lie inside the item, for zarr v3 too)
    partial: dict[str, tuple] = {}  # raw leaves not read as whole stored chunks
    for name, entry in leaves.items():
        if entry.get("value_metadata", {}).get("value_type") not in ("jax.Array", "np.ndarray"):
            continue
        layout = None if index is None or name not in index.zarrays else raw_layout(index.zarrays[name])
        raw = None if layout is None else raw_chunks(name, layout[0], index)
        if raw is not None:  # shape and dtype from the index: no TensorStore open, no Orbax
            out[name] = OrbaxArray(item_dir, name, raw.shape, raw.dtype, zarr3, item, _raw=[raw])
            continue
        if layout is not None:
            partial[name] = layout
        probe = OrbaxArray(item_dir, name, (), np.dtype(np.float32), zarr3, item)
        try:
            store = probe._open()
        except CheckpointError as e:
            if unreadable != "keep":
                raise
            out[name] = UnreadableArray(name, str(e).split(f"array {name}: ", 1)[-1][:160])
            continue
        out[name] = OrbaxArray(
            item_dir, name, tuple(int(n) for n in store.shape), np.dtype(store.dtype.numpy_dtype), zarr3,
            item, probe._store, [None],
        )
    check_item(item_dir, out, walked, item.use_ocdbt, partial)  # before any plan, allocation or write
    return out


def _one_folder_each(item_dir: str, names, where: str) -> None:
    """A CheckpointError when two leaf names of a raw item (a folder per array) are one folder on
    this filesystem (`W` and `w` where names are compared case-blind): one array read for both."""
    by_fold: dict[str, str] = {}
    for name in names:
        first = by_fold.setdefault(name.casefold(), name)
        if first == name:
            continue
        a, b = os.path.join(item_dir, first), os.path.join(item_dir, name)
        try:
            same = os.path.samefile(a, b)
        except OSError:
            same = False
        if same:
            raise CheckpointError(f"{where}: leaves {first!r} and {name!r} are one folder on this filesystem; "
                                  f"one would be read for both")
