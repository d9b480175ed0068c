"""The CRC-32 tables of a training loop's save (`CheckpointStore.save` of jax.Arrays), so that
every later read of it is checked as an import's is (`store.checked`, `hybridckpt verify RUN`).

An import records, per array, the CRC-32 of each box of a chunk grid as it streams the chunks
(`jobs.import_`). A training loop hands Orbax arrays already on the devices; here each array's
grid is its shard shape (the chunks Orbax writes for it: one per distinct shard), and each
distinct shard (`replica_id == 0`: one device of all the replicas, across processes) adds the
CRC-32 of its elements at its grid position (`checksum.crc32_of`, bytes in C order). Under
`jax.distributed` the tables are summed over the processes (each chunk set by one process, 0
elsewhere; `gather_crc_tables`), and every process gets the same record. The keys written are
the import's (`checksum_algorithm` CHUNKS, `checksum_chunks`, `checksums`, `chunk_crc32`,
`array_specs`), under the names `store.checked.recorded_name` gives the leaves.

A tree with a leaf of another kind (a `stream.LazyLeaf` of the streaming save, which records
its own; a Python scalar, whose stored dtype is Orbax's choice) records nothing: that save is
read by Orbax as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from hybridckpt import checksum
from hybridckpt.store.checked import ARRAY_SPECS, CRC_TABLES, recorded_name
from hybridckpt.store.layout import leaf_key


def _grid_and_crcs(x: Any) -> tuple[tuple[int, ...], np.ndarray]:
    """(chunk shape, CRC-32 per grid position: 0 where another process holds the chunk) of one
    jax.Array or numpy array."""
    shape = tuple(int(n) for n in x.shape)
    if not isinstance(x, jax.Array):
        data = np.asarray(x)
        return shape, np.array([checksum.crc32_of(data)], np.uint32)
    chunk = tuple(int(n) for n in x.sharding.shard_shape(x.shape))
    table = np.zeros(checksum.grid_size(shape, chunk), np.uint32)
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        box = tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(shard.index, shape, strict=True))
        if any(a >= b for a, b in box):
            continue
        table[checksum.grid_index(shape, chunk, box)] = checksum.crc32_of(np.asarray(shard.data))
    return chunk, table


def crc_record(items: Mapping[str, Any], state: Mapping[str, Any]) -> dict | None:
    """The trainer-state keys recording the CRC-32s of every array of `items` (item name ->
    tree of jax.Arrays / numpy arrays, as saved), or None when a leaf is of another kind."""
    leaves: dict[str, Any] = {}
    for item, tree in items.items():
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        for path, leaf in flat:
            if not isinstance(leaf, jax.Array | np.ndarray):
                return None
            leaves[recorded_name(item, leaf_key(path), state)] = leaf
    grids, tables = {}, {}
    for name, leaf in leaves.items():
        grids[name], tables[name] = _grid_and_crcs(leaf)
    if jax.process_count() > 1:
        tables = gather_crc_tables(tables)
    return {
        "checksum_algorithm": checksum.CHUNKS,
        "checksum_chunks": {n: list(g) for n, g in grids.items()},
        "checksums": {n: checksum.to_hex(checksum.combine(checksum.part_of(i, int(c)) for i, c in enumerate(t)))
                      for n, t in tables.items()},
        CRC_TABLES: {n: checksum.encode_crcs(t) for n, t in tables.items()},
        ARRAY_SPECS: {n: {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name} for n, leaf in leaves.items()},
    }


def gather_crc_tables(tables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every process's CRC tables summed: each chunk is written (and its entry set) by exactly
    one process, the others hold 0 there. As int32 halves (jax runs without x64)."""
    from jax.experimental import multihost_utils

    names = sorted(tables)
    flat = np.concatenate([tables[n].astype(np.int64) for n in names]) if names else np.zeros(0, np.int64)
    halves = np.stack([flat & 0xFFFF, flat >> 16]).astype(np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(halves)).astype(np.int64).sum(axis=0)
    total = (gathered[0] + (gathered[1] << 16)).astype(np.uint32)
    out, at = {}, 0
    for n in names:
        out[n] = total[at : at + len(tables[n])]
        at += len(tables[n])
    return out
