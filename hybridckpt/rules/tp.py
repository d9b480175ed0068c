"""Tensor-parallel merges: join the per-rank shards of one tensor into the global tensor.

A `tp PATTERN : concat(axis) | halves(axis) | replicated` rule (see the `hybridckpt.rules`
package docstring) names the merge; `merge_tp` performs it over shards in rank order:
`concat` joins them along `axis`; `halves` takes every shard as `[first_r | second_r]` along
`axis` and gives `[first_0 .. first_n | second_0 .. second_n]` (SwiGLU fc1, fused gate_up);
`replicated` checks that every rank holds the same shape and keeps rank 0's.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules.ops import Op


def merge_tp(shards: Sequence[LazyTensor], how: Op, where: str = "") -> LazyTensor:
    """Join the tensor-parallel shards of one tensor (rank order) by `concat`, `halves` or
    `replicated`."""
    shards = list(shards)
    if not shards:
        raise MappingError(f"{where}: no shards to merge")
    if how.name == "replicated":
        ref = shards[0]
        for i, s in enumerate(shards[1:], 1):
            if s.shape != ref.shape:
                raise MappingError(
                    f"{where}: replicated tensor has shape {ref.shape} on rank 0 but {s.shape} on rank {i}"
                )
        return ref
    if how.name == "concat":
        return lazy.concat(shards, how.args[0])
    if how.name == "halves":
        axis = how.args[0]
        firsts, seconds = [], []
        for i, s in enumerate(shards):
            n = s.shape[axis % s.ndim]
            if n % 2:
                raise MappingError(f"{where}: rank {i} shard has odd size {n} on axis {axis}; cannot halve")
            a, b = lazy.split(s, axis, (n // 2, n // 2))
            firsts.append(a)
            seconds.append(b)
        return lazy.concat(firsts + seconds, axis)
    raise MappingError(f"{where}: unknown tp merge {how}")
