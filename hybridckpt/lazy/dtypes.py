"""Stored dtypes and `--dtype`: what each tensor is written as.

Every tensor keeps the dtype it is stored in, through import, our store, restore and export: a
bf16 checkpoint whose RMSNorm weights are fp32 (GPT-OSS), whose router and score-correction bias
are fp32 (GLM-4.5) or whose indexer is fp32 (DeepSeek V3.2) comes back the same, tensor by
tensor, bit for bit. Nothing here names a model: the rule is the same for every family and for a
plain named tree.

`--dtype X` casts the floating tensors (bf16, fp16, fp32, fp8...) to X and leaves integer and
boolean tensors (counters, indices, masks) as stored; `cast_floating` does it and returns a
`CastReport` saying what it cast ("cast 62 tensors bfloat16->float32; 9 already float32").

A dequantized tensor (`lazy.quantized`: MXFP4, FP8 blocks) has no stored float dtype of its own;
its reader declares the dtype it is stored in (`Dequantized`, bfloat16: the release's own
unquantized weights' dtype, exact for MXFP4) over the exact float32 values, which `--dtype` casts
from instead (`exact`): `--dtype float32` holds the dequantized values exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hybridckpt.errors import ConfigError
from hybridckpt.lazy.base import LazyTensor
from hybridckpt.lazy.constructors import cast
from hybridckpt.lazy.views import Cast


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a `--dtype` name (float32, bfloat16, float16; fp32, bf16, fp16)."""
    import ml_dtypes

    if name in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float32", "fp32"):
        return np.dtype(np.float32)
    if name in ("float16", "fp16"):
        return np.dtype(np.float16)
    raise ConfigError(f"unknown --dtype {name!r}: expected float32, bfloat16 or float16")


def is_floating(dtype) -> bool:
    """Whether `dtype` is a real floating type (numpy's, or ml_dtypes' bfloat16 / float8 kinds)."""
    import ml_dtypes

    try:
        if np.dtype(dtype).kind == "c":  # (finfo answers for complex too)
            return False
        ml_dtypes.finfo(np.dtype(dtype))
    except (TypeError, ValueError):
        return False
    return True


class Dequantized(Cast):
    """A dequantized tensor as stored: `src` (the exact float32 values of `lazy.quantized`) read
    as `dtype`, round to nearest even. `--dtype` casts from `src` (`exact`)."""


def exact(t: LazyTensor) -> LazyTensor:
    """The values a cast starts from: a `Dequantized` tensor's exact float32 source, else `t`."""
    return t.src if isinstance(t, Dequantized) else t


@dataclass(frozen=True)
class CastReport:
    """What `cast_floating` did: `to` the dtype name asked for (None: nothing asked), `cast`
    `{from dtype name: tensors cast from it}`, `kept` floating tensors already `to`, `other`
    integer / boolean tensors left as stored."""

    to: str | None = None
    cast: Mapping[str, int] = field(default_factory=dict)
    kept: int = 0
    other: int = 0

    def note(self) -> str | None:
        """One line for a summary, or None when nothing was asked."""
        if self.to is None:
            return None
        done = "; ".join(f"cast {n} tensor{'s' * (n != 1)} {src}->{self.to}" for src, n in sorted(self.cast.items()))
        parts = [done or f"cast 0 tensors to {self.to}"]
        if self.kept:
            parts.append(f"{self.kept} already {self.to}")
        if self.other:
            parts.append(f"{self.other} not floating, kept as stored")
        return "; ".join(parts)


def cast_floating(tensors: Mapping[str, LazyTensor], dtype) -> tuple[dict[str, LazyTensor], CastReport]:
    """`tensors` with every floating one cast to `dtype` (a numpy dtype, a `--dtype` name, or
    None: each kept as stored), and what was cast. Integer and boolean tensors are kept."""
    if dtype is None:
        return dict(tensors), CastReport()
    to = np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    out: dict[str, LazyTensor] = {}
    counts: dict[str, int] = {}
    kept = other = 0
    for k, t in tensors.items():
        stored = np.dtype(t.dtype)
        if not is_floating(stored):
            out[k], other = t, other + 1
            continue
        if stored == to:
            kept += 1
        else:
            counts[stored.name] = counts.get(stored.name, 0) + 1
        out[k] = cast(exact(t), to)
    return out, CastReport(to.name, counts, kept, other)
