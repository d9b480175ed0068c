"""Layout ops of the mapping language: `Op(name, args)`, what each does, and its exact inverse.

Each op maps a list of lazy tensors to a list of lazy tensors (`Op.apply`) and has an inverse
(`Op.inverse`), so an export is derived from an import's rules and never written twice; the
table of ops and their inverses is in the `hybridckpt.rules` package docstring. Axes are
numpy's (negative counts from the end); layouts are the source's (`[out, in]` for torch
weights). `OPS` maps each op name to its implementation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules.group_ops import (
    op_deinterleave,
    op_gated_qkv,
    op_interleave,
    op_shift,
    op_ungated_qkv,
)


@dataclass(frozen=True)
class Op:
    """One layout op: `name(args)`; `apply` maps a list of tensors to a list of tensors."""

    name: str
    args: tuple = ()

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})" if self.args else self.name

    def apply(self, xs: list[LazyTensor], where: str) -> list[LazyTensor]:
        fn = OPS.get(self.name)
        if fn is None:
            raise MappingError(f"{where}: unknown op {self.name!r}")
        try:
            return fn(xs, *self.args)
        except MappingError as e:
            raise MappingError(f"{where}: {self}: {e}") from None
        except (ValueError, IndexError, TypeError, ZeroDivisionError) as e:
            shapes = [x.shape for x in xs]
            raise MappingError(f"{where}: {self} does not apply to shapes {shapes}: {e}") from None

    def for_slot(self, slot: str) -> Op:
        """The op an optimizer slot of the param takes (`SLOT_VALUE_OPS`): a layout op itself; a
        value op (a param stored as q' = c q) the moment's own rescaling."""
        if self.name == "shift":  # x + c has x's gradient: the moments are not shifted
            return Op("identity")
        if self.name not in SCALE_OPS:
            return self
        power = MOMENT_POWER.get(slot)
        if power is None:
            raise MappingError(f"op {self} rescales the param: no rule for optimizer slot {slot!r}")
        name = SLOT_VALUE_OPS.get((self.name, power))
        if name is None:
            raise MappingError(f"op {self}: no rescaling of the moment {slot!r} (power {power})")
        return Op(name, self.args)

    def inverse(self) -> Op:
        inv = _INVERSE.get(self.name)
        if inv is None:
            raise MappingError(f"op {self} has no inverse")
        return inv(self)


def _one(xs: list[LazyTensor], op: str) -> LazyTensor:
    if len(xs) != 1:
        raise MappingError(f"{op} takes one tensor, got {len(xs)}")
    return xs[0]


def _op_transpose(xs, *perm):
    x = _one(xs, "transpose")
    return [lazy.transpose(x, perm or None)]


def _op_unflatten(xs, axis, *sizes):
    x = _one(xs, "unflatten")
    axis %= x.ndim
    sizes = list(sizes)
    if sizes.count(-1) > 1:
        raise MappingError("unflatten takes at most one -1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = x.shape[axis] // known
    if math.prod(sizes) != x.shape[axis]:
        raise MappingError(f"axis {axis} of size {x.shape[axis]} is not {sizes}")
    return [lazy.reshape(x, x.shape[:axis] + tuple(sizes) + x.shape[axis + 1 :])]


def _op_flatten(xs, axis, *sizes):
    x = _one(xs, "flatten")
    axis %= x.ndim
    n = len(sizes)
    return [lazy.reshape(x, x.shape[:axis] + (-1,) + x.shape[axis + n :])]


def _op_split(xs, axis, *sizes):
    x = _one(xs, "split")
    axis %= x.ndim
    if not sizes:
        raise MappingError("split needs a count or sizes")
    if len(sizes) == 1:
        n = sizes[0]
        if x.shape[axis] % n:
            raise MappingError(f"axis {axis} of size {x.shape[axis]} does not split in {n}")
        sizes = (x.shape[axis] // n,) * n
    return lazy.split(x, axis, sizes)


def _op_concat(xs, axis, *sizes):
    if sizes and [x.shape[axis % x.ndim] for x in xs] != list(sizes):
        raise MappingError(f"parts of sizes {[x.shape[axis] for x in xs]} are not {list(sizes)}")
    return [lazy.concat(xs, axis)]


def _qkv_layout(total: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """(query heads per group, head_dim) of a fused qkv axis of `total` rows."""
    if heads % kv_heads:
        raise MappingError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    group = heads // kv_heads
    per = kv_heads * (group + 2)
    if total % per:
        raise MappingError(f"fused qkv size {total} is not a multiple of {per} head blocks")
    return group, total // per


def _op_fused_qkv(xs, axis, heads, kv_heads):
    x = _one(xs, "fused_qkv")
    axis %= x.ndim
    group, hd = _qkv_layout(x.shape[axis], heads, kv_heads)
    block = (group + 2) * hd
    qs, ks, vs = [], [], []
    for g in range(kv_heads):
        base = g * block
        qs.append(lazy.slice_axis(x, axis, base, base + group * hd))
        ks.append(lazy.slice_axis(x, axis, base + group * hd, base + (group + 1) * hd))
        vs.append(lazy.slice_axis(x, axis, base + (group + 1) * hd, base + block))
    return [lazy.concat(qs, axis), lazy.concat(ks, axis), lazy.concat(vs, axis)]


def _op_unfused_qkv(xs, axis, heads, kv_heads):
    if len(xs) != 3:
        raise MappingError(f"unfused_qkv takes q, k, v, got {len(xs)} tensors")
    q, k, v = xs
    axis %= q.ndim
    group = heads // kv_heads
    hd = k.shape[axis] // kv_heads
    if q.shape[axis] != heads * hd or v.shape[axis] != kv_heads * hd:
        raise MappingError(f"q/k/v sizes {q.shape}, {k.shape}, {v.shape} do not fit {heads}/{kv_heads} heads")
    parts = []
    for g in range(kv_heads):
        parts.append(lazy.slice_axis(q, axis, g * group * hd, (g + 1) * group * hd))
        parts.append(lazy.slice_axis(k, axis, g * hd, (g + 1) * hd))
        parts.append(lazy.slice_axis(v, axis, g * hd, (g + 1) * hd))
    return [lazy.concat(parts, axis)]


def rope_permutation(rows: int, heads: int) -> np.ndarray:
    """Row order taking interleaved RoPE pairs (Meta) to half-split (HF), per head.

    HF's permute: `w.view(heads, hd/2, 2, dim).transpose(1, 2).reshape(heads*hd, dim)`
    (huggingface/transformers:src/transformers/models/llama/convert_llama_weights_to_hf.py):
    output row (h, j, i) is input row (h, i, j) for j in {0, 1}, i < hd/2.
    """
    if rows % heads or (rows // heads) % 2:
        raise MappingError(f"{rows} rows do not form {heads} heads of even head_dim")
    hd = rows // heads
    idx = np.arange(rows).reshape(heads, hd // 2, 2).transpose(0, 2, 1).reshape(-1)
    return idx


def _op_rope_permute(xs, heads):
    x = _one(xs, "rope_permute")
    return [lazy.Take(x, 0, tuple(int(i) for i in rope_permutation(x.shape[0], heads)))]


def _op_rope_unpermute(xs, heads):
    x = _one(xs, "rope_unpermute")
    inv = np.argsort(rope_permutation(x.shape[0], heads))
    return [lazy.Take(x, 0, tuple(int(i) for i in inv))]


def _op_trim(xs, axis, size, padded=None):
    x = _one(xs, "trim")
    if size > x.shape[axis % x.ndim]:
        raise MappingError(f"cannot trim axis {axis} of size {x.shape[axis]} to {size}")
    return [lazy.slice_axis(x, axis, 0, size)]


def _op_pad(xs, axis, padded):
    x = _one(xs, "pad")
    axis %= x.ndim
    extra = padded - x.shape[axis]
    if extra < 0:
        raise MappingError(f"cannot pad axis {axis} of size {x.shape[axis]} to {padded}")
    if extra == 0:
        return [x]
    shape = list(x.shape)
    shape[axis] = extra
    return [lazy.concat([x, lazy.ArrayTensor(np.zeros(shape, dtype=x.dtype))], axis)]


def _op_cast(xs, dtype, from_dtype=None):
    x = _one(xs, "cast")
    return [lazy.cast(x, _dtype(dtype))]


def _scale_factor(kind: str, n: int) -> np.float32:
    """The float32 factor of a value op on `n` (a head_dim): sqrt(n), 1/sqrt(n), n or 1/n, each
    computed in float64 and rounded once to float32, as MaxText's hooks do."""
    if n <= 0:
        raise MappingError(f"{kind}({n}): needs a positive number")
    return np.float32({"sqrt": math.sqrt(n), "rsqrt": 1 / math.sqrt(n), "mul": n, "div": 1 / n}[kind])


def _op_scale(kind: str):
    def op(xs, n):
        x = _one(xs, f"scale_{kind}")
        return [lazy.Scaled(x, _scale_factor(kind, int(n)))]

    return op


def _op_identity(xs, *args):
    return list(xs)


def _dtype(name) -> np.dtype:
    import ml_dtypes

    if str(name) == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(str(name))
    except TypeError:
        raise MappingError(f"unknown dtype {name!r}") from None


OPS: dict[str, Callable] = {
    "transpose": _op_transpose,
    "unflatten": _op_unflatten,
    "flatten": _op_flatten,
    "split": _op_split,
    "concat": _op_concat,
    "fused_qkv": _op_fused_qkv,
    "unfused_qkv": _op_unfused_qkv,
    "rope_permute": _op_rope_permute,
    "rope_unpermute": _op_rope_unpermute,
    "trim": _op_trim,
    "pad": _op_pad,
    "cast": _op_cast,
    "identity": _op_identity,
    "scale_sqrt": _op_scale("sqrt"),
    "scale_rsqrt": _op_scale("rsqrt"),
    "scale_mul": _op_scale("mul"),
    "scale_div": _op_scale("div"),
    "interleave": op_interleave,
    "deinterleave": op_deinterleave,
    "gated_qkv": op_gated_qkv,
    "ungated_qkv": op_ungated_qkv,
    "shift": op_shift,
}


def _inv_transpose(op: Op) -> Op:
    if not op.args:
        return op
    perm = list(op.args)
    return Op("transpose", tuple(int(i) for i in np.argsort(perm)))


def _inv_trim(op: Op) -> Op:
    if len(op.args) < 3:
        raise MappingError(f"{op} cannot be inverted: give the padded size, trim(axis, size, padded)")
    return Op("pad", (op.args[0], op.args[2]))


_INVERSE: dict[str, Callable[[Op], Op]] = {
    "transpose": _inv_transpose,
    "unflatten": lambda op: Op("flatten", op.args),
    "flatten": lambda op: Op("unflatten", op.args),
    "split": lambda op: Op("concat", (op.args[0],) + (op.args[1:] if len(op.args) > 2 else ())),
    "concat": lambda op: Op("split", op.args if len(op.args) > 1 else op.args),
    "fused_qkv": lambda op: Op("unfused_qkv", op.args),
    "unfused_qkv": lambda op: Op("fused_qkv", op.args),
    "rope_permute": lambda op: Op("rope_unpermute", op.args),
    "rope_unpermute": lambda op: Op("rope_permute", op.args),
    "trim": _inv_trim,
    "pad": lambda op: Op("trim", (op.args[0], op.args[1])),
    "cast": lambda op: Op("cast", (op.args[1], op.args[0])) if len(op.args) > 1 else Op("identity"),
    "identity": lambda op: op,
    "scale_sqrt": lambda op: Op("scale_rsqrt", op.args),
    "scale_rsqrt": lambda op: Op("scale_sqrt", op.args),
    "scale_mul": lambda op: Op("scale_div", op.args),
    "scale_div": lambda op: Op("scale_mul", op.args),
    "interleave": lambda op: Op("deinterleave", op.args),
    "deinterleave": lambda op: Op("interleave", op.args),
    "gated_qkv": lambda op: Op("ungated_qkv", op.args),
    "ungated_qkv": lambda op: Op("gated_qkv", op.args),
    "shift": lambda op: Op("shift", tuple(-a for a in op.args)),
}


# Value ops and the optimizer state. A param stored as q' = c q has the gradient g / c, so a first
# moment (exp_avg, momentum_buffer) is mu / c and a second moment (exp_avg_sq) nu / c^2: Adam's
# moments that mean the same thing as the source's (Adam itself is not invariant to the rescaling:
# the next step of q' is not c times the next step of q). (op, moment power) -> the slot's op.
SCALE_OPS = ("scale_sqrt", "scale_rsqrt", "scale_mul", "scale_div")
MOMENT_POWER = {"exp_avg": 1, "momentum_buffer": 1, "exp_avg_sq": 2}
SLOT_VALUE_OPS = {
    ("scale_rsqrt", 1): "scale_sqrt",  # q' = q / sqrt(n): mu' = mu * sqrt(n)
    ("scale_rsqrt", 2): "scale_mul",  # nu' = nu * n
    ("scale_sqrt", 1): "scale_rsqrt",  # q' = q * sqrt(n): mu' = mu / sqrt(n)
    ("scale_sqrt", 2): "scale_div",  # nu' = nu / n
}
