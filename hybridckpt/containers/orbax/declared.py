"""The bytes an Orbax item's arrays declare against the bytes its files hold (issue 38).

A `.zarray` (or `zarr.json`) of a few hundred bytes can declare any shape: 2^40 elements with
no chunk behind them read as the fill value, so a plan of it is made and an import writes it
until the disk is full. `check_item` runs when the item is opened (`containers.orbax.reader.item_arrays`:
every reader of our store and of MaxText checkpoints), before a plan, an allocation or a write,
and refuses in one line naming the item, the leaf, the bytes declared and the bytes present:

- a raw leaf (zarr v2, no compressor or filters: `hybridckpt import`'s default layout) whose
  chunks are not all stored at their full size must have at least `grid chunks x chunk bytes`
  in its chunk values: an import writes every chunk, and so does Orbax
  (`STORE_ARRAY_DATA_EQUAL_TO_FILL_VALUE`), so a raw leaf missing its bytes is damaged or forged;
- every item (compressed zstd chunks, zarr v3, OCDBT or not): the arrays together declare at
  most `max(GENEROUS_FLOOR, GENEROUS_RATIO x the bytes of every file in the item)`. The ratio is
  what zstd can reach at most (RFC 8878: a block holds at most 128 KiB and costs at least 4
  bytes, an RLE block of one repeated byte: 32768:1 before the frame's own header; gzip/deflate
  stops near 1032:1, lz4 near 255:1; measured: TensorStore's zstd level 1 stores 16 MiB of zeros
  in 531 bytes, 31596:1), so no real item is refused, not even one of nothing but
  zeros (the moments of an optimizer saved before its first step); what an attacker gains is
  bounded: a few KB of files may declare at most 1 GiB.

Declared bytes are Python ints (`prod(shape) x itemsize`: exact, never wrapped). Bytes present
are sizes from the directory walk and the OCDBT index: no chunk is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np

from hybridckpt.containers.orbax.chunk_index import OCDBT_MANIFEST, ItemIndex
from hybridckpt.errors import CheckpointError

GENEROUS_FLOOR = 1 << 30  # bytes an item may declare whatever its files hold
GENEROUS_RATIO = 1 << 15  # declared : present past which an item is refused (zstd's most: module doc)
_METADATA_FILES = (".zarray", ".zattrs", ".zgroup", "zarr.json")


def declared_bytes(shape, dtype) -> int:
    """`prod(shape) x itemsize`, exact."""
    return math.prod(int(n) for n in shape) * np.dtype(dtype).itemsize


def file_bytes(item_dir: str, depth: int = 10) -> dict[str, int]:
    """Bytes of the plain files under each top-level entry of `item_dir` (`depth` levels, zarr
    metadata files not counted): for an item saved without OCDBT, an array's folder's chunks."""
    out: dict[str, int] = {}
    pending = [(item_dir, depth, None)]
    while pending:
        folder, left, top = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            raise CheckpointError(f"{folder}: cannot list the item: {e.strerror}") from e
        for entry in entries:
            key = top if top is not None else entry.name
            if entry.is_dir():
                if left > 1:
                    pending.append((entry.path, left - 1, key))
            elif entry.is_file() and entry.name not in _METADATA_FILES:
                out[key] = out.get(key, 0) + entry.stat().st_size
    return out


def index_bytes(index: ItemIndex) -> dict[str, int]:
    """Bytes of the values stored for each array in an OCDBT index (by reference or inline;
    metadata keys not counted), by array name (the key's part before its first `/`)."""
    out: dict[str, int] = {}
    values = [(k, loc.length) for k, loc in index.locations.items()]
    values += [(k, len(v)) for k, v in index.inline.items()]
    for key, n in values:
        name, _, rest = key.partition("/")
        if rest.rsplit("/", 1)[-1] not in _METADATA_FILES:
            out[name] = out.get(name, 0) + n
    return out


def check_item(item_dir: str, arrays: Mapping, index: ItemIndex | None, ocdbt: bool,
               raw_layouts: Mapping[str, tuple] | None = None) -> None:
    """A CheckpointError when the arrays of the item (`name -> LazyTensor`; other values are
    skipped) declare more bytes than the item holds (the rules of the module doc).

    index: the item's `ItemIndex` when it could be read (an OCDBT item's per-array bytes come
    from it); ocdbt: whether the item is one OCDBT database (else a folder per array);
    raw_layouts: `name -> containers.orbax.reader.raw_layout(...)` of the raw leaves not read as whole
    stored chunks."""
    files = file_bytes(item_dir)
    per_leaf = index_bytes(index) if ocdbt and index is not None else files
    sized = {k: v for k, v in arrays.items() if hasattr(v, "shape") and hasattr(v, "dtype")}
    declared = {k: declared_bytes(v.shape, v.dtype) for k, v in sized.items()}
    for name, (shape, chunk, dtype, _) in (raw_layouts or {}).items():
        grid = math.prod(-(-n // c) for n, c in zip(shape, chunk, strict=True))
        need = grid * math.prod(chunk) * dtype.itemsize
        have = per_leaf.get(name, 0)
        if have < need:
            raise CheckpointError(
                f"{item_dir}: leaf {name!r} ({dtype.name} {list(shape)}) declares {declared_bytes(shape, dtype)} "
                f"bytes stored raw ({grid} chunks of {math.prod(chunk) * dtype.itemsize} bytes) but its chunks "
                f"hold {have} bytes; refused before planning"
            )
    total, present = sum(declared.values()), sum(files.values())
    if declared and total > max(GENEROUS_FLOOR, GENEROUS_RATIO * present):
        name = max(declared, key=declared.__getitem__)
        t = sized[name]
        if ocdbt and index is None:  # (read by Orbax: the index is walked only to say this)
            per_leaf = _index_bytes_or_none(item_dir)
        raise CheckpointError(
            f"{item_dir}: the item's arrays declare {total} bytes but its files hold {present} bytes "
            f"(the most for leaf {name!r}, {np.dtype(t.dtype).name} {list(t.shape)}: {declared[name]} bytes "
            f"declared, {per_leaf.get(name, 0) if per_leaf is not None else '?'} bytes stored for it); more than {GENEROUS_RATIO} x the bytes "
            f"present: refused before planning"
        )


def _index_bytes_or_none(item_dir: str) -> dict[str, int] | None:
    from hybridckpt.containers.orbax.chunk_index import read_index

    try:
        return index_bytes(read_index(item_dir))
    except CheckpointError:
        return None


def check_orbax_tree(item_dir: str, tree) -> None:
    """`check_item`'s item bound for an item read by Orbax itself (`CheckpointStore.restore`
    without CRC tables): `tree` is Orbax's metadata of the item (leaves with `shape` and
    `dtype`), checked before Orbax allocates the restored arrays."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    arrays = {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in leaves if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}
    check_item(item_dir, arrays, None, os.path.isfile(os.path.join(item_dir, OCDBT_MANIFEST)))
