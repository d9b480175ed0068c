"""Dequantizing views: a quantized tensor read as float32, box by box, without torch.

- `BlockScaled`  fine-grained FP8 (DeepSeek V3 / R1 / V3.2, Kimi K2, transformers'
                 `FineGrainedFP8Config`): `values` `[..., out, in]` (float8_e4m3fn) times one
                 float32 multiplier per `[block_out, block_in]` block, `scales`
                 `[..., ceil(out / block_out), ceil(in / block_in)]` (the checkpoint's
                 `weight_scale_inv`: a multiplier despite its name). The grid is anchored at 0, so
                 the last row and column of blocks may be partial. Value = `float32(q) * scale`,
                 rounded once to float32: what DeepSeek's `weight_dequant` kernel computes
                 (deepseek-ai/DeepSeek-V3: inference/kernel.py) before it stores the result.
                 A scale grid stored as uint8 is E8M0 (`2^(byte - 127)`).
- `Mxfp4`        MXFP4 (GPT-OSS expert weights): `blocks` `[..., G, 16]` uint8, each byte two
                 e2m1 codes, low nibble first, and `scales` `[..., G]` uint8 E8M0; element
                 `32 g + 2 j (+1)` of a row is code `blocks[..., g, j] & 0xF` (`>> 4`) times
                 `2^(scales[..., g] - 127)`. Shape `[..., 32 G]`. The power of two is formed in
                 float32 as torch's `ldexp` forms it (transformers' `convert_moe_packed_tensors`,
                 gpt-oss `weights.py`): exponent 128 is inf, -127 a subnormal; every finite value
                 is exact in float32 and in bfloat16.

A box reads only the quantized bytes and the scales of the blocks it touches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridckpt.errors import FormatError
from hybridckpt.lazy.base import LazyTensor
from hybridckpt.lazy.box import Box

F32 = np.dtype(np.float32)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], F32)
MX_GROUP = 32  # elements per MXFP4 scale (16 bytes)


def e8m0(raw: np.ndarray) -> np.ndarray:
    """float32 `2^(raw - 127)` of uint8 E8M0 exponents, as `torch.pow(2.0, e)` forms it (255: inf)."""
    with np.errstate(over="ignore"):
        return np.ldexp(np.float32(1.0), raw.astype(np.int32) - 127).astype(F32)


def _grid(n: int, block: int) -> int:
    return -(-n // block)


@dataclass(frozen=True, eq=False)
class BlockScaled(LazyTensor):
    """`values` times `scales` per `block` (`(block_out, block_in)`) over its last two dims, as
    float32 (module doc)."""

    values: LazyTensor
    scales: LazyTensor
    block: tuple[int, int]

    def __post_init__(self):
        shape, sshape = tuple(self.values.shape), tuple(self.scales.shape)
        bo, bi = self.block
        if len(shape) < 2 or bo < 1 or bi < 1:
            raise FormatError(f"block-scaled tensor of shape {shape}: needs 2+ dims and blocks >= 1, found {self.block}")
        want = (*shape[:-2], _grid(shape[-2], bo), _grid(shape[-1], bi))
        if sshape != want:
            raise FormatError(
                f"scales of shape {sshape} do not fit a tensor of shape {shape} in blocks of {list(self.block)}: "
                f"expected {want}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        return F32

    def _scale_box(self, box: Box) -> Box:
        (r0, r1), (c0, c1) = box[-2], box[-1]
        bo, bi = self.block
        return (*box[:-2], (r0 // bo, _grid(r1, bo)), (c0 // bi, _grid(c1, bi)))

    def read_box(self, box: Box) -> np.ndarray:
        q = self.values.read_box(box).astype(F32)
        if q.size == 0:
            return q
        sbox = self._scale_box(box)
        s = self.scales.read_box(sbox)
        s = e8m0(s) if s.dtype == np.uint8 else s.astype(F32)
        (r0, r1), (c0, c1) = box[-2], box[-1]
        bo, bi = self.block
        rows = np.arange(r0, r1) // bo - sbox[-2][0]
        cols = np.arange(c0, c1) // bi - sbox[-1][0]
        full = s[..., rows, :][..., cols]
        return q * full


@dataclass(frozen=True, eq=False)
class Mxfp4(LazyTensor):
    """MXFP4 `blocks` `[..., G, 16]` and E8M0 `scales` `[..., G]` as float32 `[..., 32 G]`."""

    blocks: LazyTensor
    scales: LazyTensor

    def __post_init__(self):
        b, s = tuple(self.blocks.shape), tuple(self.scales.shape)
        if len(b) < 2 or b[-1] != MX_GROUP // 2 or b[:-1] != s:
            raise FormatError(f"MXFP4 blocks {b} and scales {s}: expected blocks [..., G, 16] and scales [..., G]")
        for what, t in (("blocks", self.blocks), ("scales", self.scales)):
            if np.dtype(t.dtype) != np.uint8:
                raise FormatError(f"MXFP4 {what}: expected uint8, found {np.dtype(t.dtype)}")

    @property
    def shape(self) -> tuple[int, ...]:
        b = tuple(self.blocks.shape)
        return (*b[:-2], b[-2] * MX_GROUP)

    @property
    def dtype(self) -> np.dtype:
        return F32

    def read_box(self, box: Box) -> np.ndarray:
        a, b = box[-1]
        if b <= a or any(hi <= lo for lo, hi in box[:-1]):
            return np.empty(tuple(hi - lo for lo, hi in box), F32)
        g0, g1 = a // MX_GROUP, _grid(b, MX_GROUP)
        raw = self.blocks.read_box((*box[:-1], (g0, g1), (0, MX_GROUP // 2)))
        exp = e8m0(self.scales.read_box((*box[:-1], (g0, g1))))
        codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(*raw.shape[:-1], MX_GROUP)
        with np.errstate(invalid="ignore"):  # 0 * inf (exponent 128) is nan, as in torch
            vals = E2M1[codes] * exp[..., None]
        vals = vals.reshape(*raw.shape[:-2], (g1 - g0) * MX_GROUP)
        return np.ascontiguousarray(vals[..., a - g0 * MX_GROUP : b - g0 * MX_GROUP])

