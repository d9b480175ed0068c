"""Layout ops that regroup rows by heads: parts of several tensors taken group by group.

- `interleave(axis, groups, s0, s1, ...)`: many -> one. Each source i is cut along `axis` into
  `groups` equal blocks of `s_i` rows; the result is `[x0 block 0 | x1 block 0 | ... | x0 block 1
  | x1 block 1 | ...]`. Megatron-Core keeps the gated delta net's in_proj as separate per-kind
  tensors `query | key | value | z` (and `beta | alpha`), each heads in order; HF Qwen3-Next's
  `in_proj_qkvz` / `in_proj_ba` hold them grouped per key head `[q_h; k_h; v_h; z_h]`
  (Megatron-Bridge param_mapping.py `merge_gdn_linear_weights` / `split_gdn_linear_weights`).
  Inverse: `deinterleave(axis, groups, s0, s1, ...)`, one -> many.
- `gated_qkv(axis, heads, kv_heads)`: one -> three. Megatron's fused `linear_qkv` with an output
  gate (`attention_output_gate`) holds per query group `[q heads | gate heads | k | v]`, each
  head `head_dim` rows (Bridge `merge_qkv_weights` with `attention_output_gate`); HF's gated
  `q_proj` holds per head `[q_h; gate_h]`, then `k_proj`, `v_proj`. Inverse: `ungated_qkv`.
"""

from __future__ import annotations

from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor


def _positive(*ns) -> None:
    if any(not isinstance(n, int) or n <= 0 for n in ns):
        raise MappingError(f"group sizes must be positive ints, got {list(ns)}")


def op_interleave(xs: list[LazyTensor], axis, groups, *sizes) -> list[LazyTensor]:
    _positive(groups, *sizes)
    if len(sizes) != len(xs):
        raise MappingError(
            f"interleave of {len(xs)} tensors needs {len(xs)} block sizes, got {len(sizes)}"
        )
    axis %= xs[0].ndim
    for x, s in zip(xs, sizes, strict=True):
        if x.shape[axis] != groups * s:
            raise MappingError(f"axis {axis} of size {x.shape[axis]} is not {groups} blocks of {s}")
    parts = [
        lazy.slice_axis(x, axis, g * s, (g + 1) * s)
        for g in range(groups)
        for x, s in zip(xs, sizes, strict=True)
    ]
    return [lazy.concat(parts, axis)]


def op_deinterleave(xs: list[LazyTensor], axis, groups, *sizes) -> list[LazyTensor]:
    if len(xs) != 1:
        raise MappingError(f"deinterleave takes one tensor, got {len(xs)}")
    _positive(groups, *sizes)
    (x,) = xs
    axis %= x.ndim
    block = sum(sizes)
    if x.shape[axis] != groups * block:
        raise MappingError(
            f"axis {axis} of size {x.shape[axis]} is not {groups} groups of {list(sizes)}"
        )
    outs = []
    for i, s in enumerate(sizes):
        off = sum(sizes[:i])
        outs.append(
            lazy.concat(
                [
                    lazy.slice_axis(x, axis, g * block + off, g * block + off + s)
                    for g in range(groups)
                ],
                axis,
            )
        )
    return outs


def _gated_layout(total: int, heads, kv_heads) -> tuple[int, int]:
    _positive(heads, kv_heads)
    if heads % kv_heads:
        raise MappingError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    group = heads // kv_heads
    per = kv_heads * (2 * group + 2)
    if total % per:
        raise MappingError(f"gated qkv size {total} is not a multiple of {per} head blocks")
    return group, total // per


def op_gated_qkv(xs: list[LazyTensor], axis, heads, kv_heads) -> list[LazyTensor]:
    if len(xs) != 1:
        raise MappingError(f"gated_qkv takes one tensor, got {len(xs)}")
    (x,) = xs
    axis %= x.ndim
    group, hd = _gated_layout(x.shape[axis], heads, kv_heads)
    block = (2 * group + 2) * hd
    qg, ks, vs = [], [], []
    for g in range(kv_heads):
        base = g * block
        for h in range(group):  # HF q_proj: per head [q_h; gate_h]
            q0, g0 = base + h * hd, base + (group + h) * hd
            qg += [lazy.slice_axis(x, axis, q0, q0 + hd), lazy.slice_axis(x, axis, g0, g0 + hd)]
        k0 = base + 2 * group * hd
        ks.append(lazy.slice_axis(x, axis, k0, k0 + hd))
        vs.append(lazy.slice_axis(x, axis, k0 + hd, k0 + 2 * hd))
    return [lazy.concat(qg, axis), lazy.concat(ks, axis), lazy.concat(vs, axis)]


def op_ungated_qkv(xs: list[LazyTensor], axis, heads, kv_heads) -> list[LazyTensor]:
    if len(xs) != 3:
        raise MappingError(f"ungated_qkv takes q_proj, k, v, got {len(xs)} tensors")
    _positive(heads, kv_heads)
    qg, k, v = xs
    axis %= qg.ndim
    hd = k.shape[axis] // kv_heads
    group = heads // kv_heads
    if hd <= 0 or heads % kv_heads or qg.shape[axis] != 2 * heads * hd or v.shape[axis] != kv_heads * hd \
            or k.shape[axis] != kv_heads * hd:  # fmt: skip
        raise MappingError(
            f"q/k/v sizes {qg.shape}, {k.shape}, {v.shape} do not fit {heads}/{kv_heads} gated heads"
        )
    parts = []
    for g in range(kv_heads):
        heads_g = range(g * group, (g + 1) * group)
        parts += [lazy.slice_axis(qg, axis, 2 * h * hd, (2 * h + 1) * hd) for h in heads_g]
        parts += [lazy.slice_axis(qg, axis, (2 * h + 1) * hd, (2 * h + 2) * hd) for h in heads_g]
        parts += [
            lazy.slice_axis(k, axis, g * hd, (g + 1) * hd),
            lazy.slice_axis(v, axis, g * hd, (g + 1) * hd),
        ]
    return [lazy.concat(parts, axis)]


def op_shift(xs: list[LazyTensor], offset) -> list[LazyTensor]:
    """`x + offset` (a zero-centred norm weight: `shift(1)` gives HF's plain w from Megatron's
    w - 1); the inverse is `shift(-offset)`; an optimizer moment is not shifted (`Op.for_slot`)."""
    if len(xs) != 1:
        raise MappingError(f"shift takes one tensor, got {len(xs)}")
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise MappingError(f"shift takes an int offset, got {offset!r}")
    return [lazy.Shifted(xs[0], offset)]
