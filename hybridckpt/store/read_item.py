"""One item of a step of our store (params, opt_state) restored onto the shardings of a target tree,
every byte checked against the CRC-32s the import recorded (`store.checked`).

`read_items` is what `CheckpointStore.restore` calls, for the items it restores at once. Each
array goes one of two ways:

- by chunks (`store.chunk_fill`): a raw chunk grid restored in its stored dtype, the common case
  of a store our import wrote: every chunk this process's boxes meet read once, checked whole,
  copied into each shard it meets, the chunks of all such arrays taken in order by the reader
  pool's threads;
- box by box (`place.to_array` over a `CheckedArray`, `PLACED_AT_ONCE` arrays at a time): every
  other array (TensorStore decodes it, a cast, reads unchecked, edge chunks stored padded, ...).

Each device reads only the chunks its shard touches; leaves the item lacks stay abstract (as
Orbax's partial restore leaves them). Split out of `store.checked` (its module was near its
500-line limit, and the fill by chunks imports it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.lazy.parallel import io_threads
from hybridckpt.store.checked import (
    SCRATCH_PIECE_BYTES,
    CheckedArray,
    checked_arrays,
    recorded_name,
)
from hybridckpt.store.chunk_fill import ArrayFill, fill_arrays

PLACED_AT_ONCE = 2  # arrays placed box by box at a time: the next one's boxes queue behind the
# one being read, so a reader thread its last boxes leave idle starts the next array at once
# (one array at a time, the threads waited at each array's end for the slowest box)


def read_tree(step_dir: str, item: str, target, state: Mapping, *, verify: bool = True, found=None):
    """The item `item` of a step restored onto `target`'s shardings (a tree of
    `jax.ShapeDtypeStruct`), every chunk checked (`CheckedArray`; `verify=False`: as stored;
    `found`: the item's `item_arrays` opened already): `read_items` of that one item."""
    return read_items(step_dir, {item: target}, state, verify=verify, found={item: found})[item]


def read_items(step_dir: str, targets: Mapping[str, Any], state: Mapping, *, verify: bool = True,
               found: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Each item of `targets` (item -> a tree of `jax.ShapeDtypeStruct`) of a step restored onto
    its shardings (see the module doc), every chunk checked unless `verify=False`; `found`: per
    item, its `item_arrays` opened already (or None). The arrays of every item are filled by
    chunks in one pass (params, then the optimizer state, in leaf order: the workers go from one
    item's chunks to the next without a pause), then the rest box by box."""
    from hybridckpt.containers.orbax.reader import item_arrays
    from hybridckpt.place import to_array
    from hybridckpt.store.layout import has_shape, leaf_key

    # (a worker's chunk to cut, or a scratch piece or chunk being cut a reader thread and as many
    # kept for the pieces other threads cut from them next; each up to SCRATCH_PIECE_BYTES lent a
    # buffer of that size, reused array after array; larger ones dropped: `io.aligned_pool`'s `unit`)
    scratch = AlignedPool(2 * io_threads() * SCRATCH_PIECE_BYTES, unit=SCRATCH_PIECE_BYTES)
    trees, leaves, by_chunks, box_by_box = {}, {}, {}, []  # (item, leaf index) -> array or fill
    for item, target in targets.items():
        folder = os.path.join(step_dir, item)
        have = (found or {}).get(item)
        have = item_arrays(folder) if have is None else have
        flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=has_shape)
        trees[item] = (flat, treedef)
        names = {leaf_key(path): recorded_name(item, leaf_key(path), state) for path, _ in flat}
        wanted = {names[k]: have[k] for k in names if k in have}
        checked = checked_arrays(wanted, state, "", folder) if verify else wanted
        for i, (path, leaf) in enumerate(flat):
            key = leaf_key(path)
            if key not in have:
                leaves[item, i] = leaf
                continue
            t = checked[names[key]]
            if isinstance(t, CheckedArray):  # (an unchecked array of the item is named `key` already)
                t.name = key
            if ArrayFill.eligible(t, leaf.dtype):
                by_chunks[item, i] = ArrayFill(t, leaf.sharding)
            box_by_box.append((item, i, t, leaf))

    def place(t, leaf):
        if isinstance(t, CheckedArray):
            t.direct, t.scratch = True, scratch  # (pieces straight into the shards: checked whole by `release` below at the latest)
        arr, _ = to_array(t, leaf.sharding, np.dtype(leaf.dtype) if np.dtype(leaf.dtype) != t.dtype else None,
                          with_checksum=False)
        if isinstance(t, CheckedArray):
            t.release()  # (the rest of chunks cut for another process's devices)
            scratch.trim()
        return arr

    try:
        where = {id(f): k for k, f in by_chunks.items()}
        for fill, arr in fill_arrays(list(by_chunks.values()), scratch):
            leaves[where[id(fill)]] = arr
        rest = [(item, i, t, leaf) for item, i, t, leaf in box_by_box if (item, i) not in leaves]
        with ThreadPoolExecutor(PLACED_AT_ONCE, thread_name_prefix="hybridckpt-place") as placing:
            futures = {(item, i): placing.submit(place, t, leaf) for item, i, t, leaf in rest}
            try:
                for k, f in futures.items():
                    leaves[k] = f.result()
            except BaseException:  # (the first error in leaf order; arrays not begun are not read)
                for f in futures.values():
                    f.cancel()
                raise
    finally:
        scratch.clear()
    return {item: jax.tree_util.tree_unflatten(treedef, [leaves[item, i] for i in range(len(flat))])
            for item, (flat, treedef) in trees.items()}
