"""Lazy tensors placed on a mesh as global `jax.Array`s, each device reading only its box.

`to_array` is the eager counterpart of the streaming save (`store.stream`): for `logits`, tests
and library users who want arrays in memory rather than a checkpoint on disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from hybridckpt import checksum, lazy
from hybridckpt.io import timing
from hybridckpt.lazy import LazyTensor, parallel
from hybridckpt.naming import flatten, nest
from hybridckpt.plan import box_holders, box_owners


def to_array(t: LazyTensor, sharding: jax.sharding.Sharding, dtype=None, *, with_checksum: bool = True
             ) -> tuple[jax.Array, int]:
    """A global jax.Array of `t` placed by `sharding`, and the checksum (`hybridckpt.checksum`)
    of the boxes this process owns (`plan.box_owners`).

    Each distinct box of this process's devices is read once, by the reader pool
    (`hybridckpt.lazy.parallel`, at most `io_threads()` boxes held at a time), into its own buffer,
    which goes straight to every device holding it (`jax.device_put` per shard): no host copy
    of the global array is ever made, and reads overlap host-to-device transfers.
    `with_checksum=False` skips the checksum (0): a restore whose reads are checked already.
    """
    if dtype is not None:
        t = lazy.cast(t, dtype)
    shape = tuple(t.shape)
    holders = box_holders(shape, sharding)
    owner = box_owners(shape, sharding)
    me = jax.process_index()

    def read(box):
        buf = parallel.read_box_parallel(t, box)
        if not with_checksum or owner[box].process_index != me:
            return box, buf, 0
        with timing.stage("checksum", buf.nbytes):
            return box, buf, checksum.box_part(shape, box, buf)

    shards: list[jax.Array] = []
    parts: list[int] = []
    for box, buf, part in parallel.imap_bounded(read, list(holders), parallel.io_threads()):
        parts.append(part)
        with timing.stage("transfer", buf.nbytes * len(holders[box])):
            shards.extend(jax.device_put(buf, dev) for dev in holders[box])
        del buf
    with timing.stage("transfer"):
        arr = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return arr, checksum.combine(parts)


def assemble(
    tree: Mapping[str, Any], shardings: Mapping[str, Any], dtype=None, on_leaf=None, checksums=None, prefix=""
) -> dict:
    """Nested dict of LazyTensors -> nested dict of jax.Arrays placed by matching `shardings`.

    checksums: a dict that receives `prefix + path -> checksum hex` per leaf.
    """
    flat_s = flatten(shardings)
    out = {}
    for k, t in flatten(tree).items():
        out[k], crc = to_array(t, flat_s[k], dtype)
        if checksums is not None:
            checksums[prefix + k] = checksum.to_hex(crc)
        if on_leaf:
            on_leaf(k, t.nbytes)
    return nest(out)
