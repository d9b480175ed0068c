"""`Scaled`: a tensor times a float32 factor, computed in float32 and cast back (a change of
parameterization, e.g. MaxText's query kernel stored as q / sqrt(head_dim)).

The arithmetic is fixed so that a writer and the tool it imitates give the same bits:
`(x.astype(float32) * float32(factor)).astype(x.dtype)`, which is what MaxText's
`scale_query_layer` hook does (maxtext 0.2.5 checkpoint_conversion/utils/param_mapping.py,
LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN). The factor is given as the float32 value itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridckpt.lazy.base import LazyTensor
from hybridckpt.lazy.box import Box


@dataclass(frozen=True, eq=False)
class _InFloat32(LazyTensor):
    """`src` through `op` computed in float32, cast back to `src`'s dtype (elementwise: any box
    reads the same box of `src`)."""

    src: LazyTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.src.dtype)

    def op(self, x: np.ndarray) -> np.ndarray:
        """The float32 result of the float32 array `x`."""
        raise NotImplementedError

    def read_box(self, box: Box) -> np.ndarray:
        return self.op(self.src.read_box(box).astype(np.float32)).astype(self.dtype)


@dataclass(frozen=True, eq=False)
class Scaled(_InFloat32):
    """`src * factor` in float32, in `src`'s dtype (elementwise: any box reads the same box)."""

    factor: np.float32

    def op(self, x: np.ndarray) -> np.ndarray:
        return x * np.float32(self.factor)


@dataclass(frozen=True, eq=False)
class Shifted(_InFloat32):
    """`src + offset` in float32, in `src`'s dtype (elementwise): a norm weight stored
    zero-centred (`w - 1`, Megatron's `layernorm_zero_centered_gamma` on a norm HF keeps plain,
    Megatron-Bridge's `RMSNorm2ZeroCenteredRMSNormMapping` adds / subtracts the 1 so)."""

    offset: np.float32

    def op(self, x: np.ndarray) -> np.ndarray:
        return x + np.float32(self.offset)
