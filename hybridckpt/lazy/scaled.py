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
from hybridckpt.lazy.element_copy import copy_into


@dataclass(frozen=True, eq=False)
class Scaled(LazyTensor):
    """`src * factor` in float32, in `src`'s dtype (elementwise: any box reads the same box)."""

    src: LazyTensor
    factor: np.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.src.dtype)

    def read_box(self, box: Box) -> np.ndarray:
        x = self.src.read_box(box)
        return (x.astype(np.float32) * np.float32(self.factor)).astype(self.dtype)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        copy_into(out, self.read_box(box))


@dataclass(frozen=True, eq=False)
class Shifted(LazyTensor):
    """`src + offset` in float32, in `src`'s dtype (elementwise): a norm weight stored
    zero-centred (`w - 1`, Megatron's `layernorm_zero_centered_gamma` on a norm HF keeps plain,
    Megatron-Bridge's `RMSNorm2ZeroCenteredRMSNormMapping` adds / subtracts the 1 so)."""

    src: LazyTensor
    offset: np.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.src.dtype)

    def read_box(self, box: Box) -> np.ndarray:
        x = self.src.read_box(box)
        return (x.astype(np.float32) + np.float32(self.offset)).astype(self.dtype)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        copy_into(out, self.read_box(box))
