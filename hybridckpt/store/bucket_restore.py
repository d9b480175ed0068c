"""A step of our store in a bucket, restored by our own reader instead of Orbax (issue 43); and
a local step whose restore our reader does (CRC-checked, `CheckpointStore._item_tree`), whose
items' metadata it reads the same way: each item's `_METADATA` and arrays once, where Orbax's
`metadata(step)` reads every item's tree for any one (10-20 ms of the serial start, issue 42).

Orbax reads an item's array metadata, and restores its arrays, through TensorStore specs it
builds from the item folder's path (`file` kvstores). For a store in a bucket that folder is a
local view (`io.remote.view`) whose data files are sparse placeholders: an OCDBT item's zarr
metadata and every chunk lie in them, so Orbax would read zeros. What `CheckpointStore` asks of
Orbax for such a step is answered here from the bucket itself, by byte ranges:

- `open_item(item_dir).tree`: the item's tree as Orbax's `item_metadata` gives it (dicts and lists
  nested as the key paths of `_METADATA` say, `None` / `{}` / `[]` for empty nodes), with a
  `jax.ShapeDtypeStruct` per array: its shape and dtype from our reader
  (`containers.orbax.reader.item_arrays`: a raw item's `.zarray` from the view, an OCDBT item's
  from its index, which TensorStore reads from the bucket, `io.remote.ts_kvstore`);
- the arrays (`CheckpointStore.restore`, any `verify_reads`) by `store.read_item.read_items`, each
  device reading the chunks of its shard (raw chunks by our ranged GETs, compressed chunks by
  TensorStore from the bucket, its GETs counted for the host: `ts_kvstore.settle`), each chunk
  checked against its import's CRC-32 unless `verify_reads=False` (then read as stored, as Orbax
  would) or the step recorded none.

`_METADATA` is untrusted: a key path's list index is at most the number of leaves (no list is
grown past what the file lists), a node is either a dict or a list, never both, nor a leaf too;
a leaf that is neither an array nor an empty node (a Python scalar or string, which our store
never writes) is refused in one line, since only Orbax reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hybridckpt.errors import CheckpointError, short_repr

SEQUENCE, DICT = 1, 2  # `_METADATA` key types (Orbax's `tree.KeyType`)
ARRAY_TYPES = ("jax.Array", "np.ndarray")
EMPTY = {"None": lambda: None, "NamedTuple": lambda: None, "Dict": dict, "List": list, "Tuple": tuple}  # Orbax's empties


def in_bucket(path: str) -> bool:
    """Whether `path` lies in a local view of object storage (`io.remote.view`)."""
    from hybridckpt.io.remote.view import url_of

    return url_of(path) is not None


@dataclass(frozen=True)
class BucketItem:
    """One item of a step in a bucket, opened once for a restore: `arrays` (leaf name -> our
    reader's lazy array, `containers.orbax.reader.item_arrays`) and `tree` (Orbax's metadata tree
    of the item, a `jax.ShapeDtypeStruct` per array)."""

    arrays: dict
    tree: Any


def open_item(item_dir: str) -> BucketItem | None:
    """The item at `item_dir` (see the module doc), or None when the step has no such item."""
    import jax
    import numpy as np

    from hybridckpt.containers.orbax.keys import metadata_leaf_names
    from hybridckpt.containers.orbax.reader import item_arrays
    from hybridckpt.io.config_file import read_json

    if not os.path.isdir(item_dir):
        return None
    meta_path = os.path.join(item_dir, "_METADATA")
    leaves = metadata_leaf_names(read_json(meta_path), meta_path)
    arrays = item_arrays(item_dir)
    flat = []
    for name, entry in leaves.items():
        value_type = entry.get("value_metadata", {}).get("value_type")
        if value_type in ARRAY_TYPES:
            t = arrays[name]
            value = jax.ShapeDtypeStruct(tuple(t.shape), np.dtype(t.dtype))
        elif value_type in EMPTY:
            value = EMPTY[value_type]()
        else:
            raise CheckpointError(f"{meta_path}: leaf {short_repr(name)} is a {short_repr(value_type)}, not an array; "
                                  f"only Orbax reads it, and Orbax does not read a store in object storage")
        flat.append(([(k["key"], k.get("key_type")) for k in entry["key_metadata"]], value))
    return BucketItem(arrays, nest(flat, meta_path))


def nest(flat: list[tuple[list[tuple[Any, Any]], Any]], where: str) -> Any:
    """The tree of `flat` ((key path, value) pairs; a key is (key, key type), `SEQUENCE` keys
    list indices, `DICT` keys dict keys), as Orbax's `from_flattened_with_keypath` builds it:
    lists padded with None up to their highest index. A CheckpointError names `where` for a key
    path that does not fit the others or an index past the leaves listed."""
    if not flat:
        return {}
    if len(flat) == 1 and not flat[0][0]:
        return flat[0][1]
    limit = len(flat)
    root: list = [None]  # a cell holding the tree

    def child(node, key, kind, value, leaf: bool):
        """Place `value` (a leaf, or a new node unless one is there) at `key` of `node`."""
        if kind == DICT:
            if not isinstance(node, dict):
                raise CheckpointError(f"{where}: key {short_repr(key)} is a dict key of a node that is not a dict")
            slot = str(key)
            if leaf and slot in node:
                raise CheckpointError(f"{where}: leaf {short_repr(key)} listed twice, or also a node")
            return node.setdefault(slot, value)
        if kind != SEQUENCE or not isinstance(node, list):
            raise CheckpointError(f"{where}: key {short_repr(key)} of type {short_repr(kind)} does not fit its node")
        text = str(key)
        if not text.isdigit() or len(text) > 9 or int(text) >= limit:
            raise CheckpointError(f"{where}: list index {short_repr(key)} is not below the {limit} leaves listed")
        i = int(text)
        node.extend([_HOLE] * (i + 1 - len(node)))
        if leaf and node[i] is not _HOLE:
            raise CheckpointError(f"{where}: leaf at index {i} listed twice, or also a node")
        if node[i] is _HOLE:
            node[i] = value
        return node[i]

    for path, value in flat:
        if root[0] is None:
            root[0] = {} if path[0][1] == DICT else []
        node = root[0]
        for depth, (key, kind) in enumerate(path):
            if depth == len(path) - 1:
                child(node, key, kind, value, True)
            else:
                node = child(node, key, kind, {} if path[depth + 1][1] == DICT else [], False)
                if not isinstance(node, dict | list):
                    raise CheckpointError(f"{where}: key {short_repr(key)} is both a leaf and a node")
    return _holes_to_none(root[0])


_HOLE = object()  # a list slot no key path names (Orbax leaves None there)


def _holes_to_none(node):
    if isinstance(node, dict):
        return {k: _holes_to_none(v) for k, v in node.items()}
    if isinstance(node, list):
        return [None if v is _HOLE else _holes_to_none(v) for v in node]
    return node
