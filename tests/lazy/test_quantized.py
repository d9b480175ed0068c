"""Dequantizing views and the HF quantization config against hostile or inconsistent input: one
FormatError naming what is wrong; and the values against a direct computation (the real-tool
references are in tests/real/test_real_hf_quantized.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hybridckpt.errors import FormatError
from hybridckpt.formats.hf import quant as hf_quant
from hybridckpt.lazy import ArrayTensor
from hybridckpt.lazy.quantized import BlockScaled, Mxfp4, e8m0

F8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _fp8(shape, seed=0):
    r = np.random.default_rng(seed)
    return ArrayTensor((r.standard_normal(shape) * 50).astype(F8))


def test_block_scaled_partial_edges_equal_a_direct_expansion():
    q = _fp8((2, 37, 21))
    s = np.random.default_rng(1).random((2, 3, 2)).astype(np.float32)
    got = BlockScaled(q, ArrayTensor(s), (16, 16)).materialize()
    full = np.repeat(np.repeat(s, 16, axis=1), 16, axis=2)[:, :37, :21]
    np.testing.assert_array_equal(got, q.materialize().astype(np.float32) * full)


def test_block_scaled_e8m0_scales():
    q = _fp8((4, 4))
    raw = np.array([[126, 130]], np.uint8)
    got = BlockScaled(q, ArrayTensor(raw), (4, 2)).materialize()
    want = q.materialize().astype(np.float32) * np.array([[0.5, 0.5, 8.0, 8.0]], np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sshape", [(3, 2), (2, 1), (1, 2, 2)])
def test_block_scaled_refuses_a_grid_that_does_not_fit(sshape):
    with pytest.raises(FormatError, match="do not fit a tensor of shape"):
        BlockScaled(_fp8((20, 20)), ArrayTensor(np.ones(sshape, np.float32)), (16, 16))


def test_mxfp4_layout_and_special_exponents():
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x7F  # low nibble 0xF (-6), high 0x7 (6)
    blocks[0, 0, 1] = 0x21  # low 0.5, high 1.0
    got = Mxfp4(ArrayTensor(blocks), ArrayTensor(np.array([[128]], np.uint8))).materialize()
    assert got.shape == (1, 32)
    np.testing.assert_array_equal(got[0, :4], [-12.0, 12.0, 1.0, 2.0])
    inf = Mxfp4(ArrayTensor(blocks), ArrayTensor(np.array([[255]], np.uint8))).materialize()
    assert np.isinf(inf[0, 0]) and np.isnan(inf[0, 4])  # 2^128 overflows float32, as torch.pow(2.0, 128)
    assert e8m0(np.array([0], np.uint8))[0] == np.float32(2.0**-127)  # a float32 subnormal, exact


def test_mxfp4_box_reads_cross_groups():
    r = np.random.default_rng(2)
    blocks = ArrayTensor(r.integers(0, 256, (3, 4, 16), dtype=np.uint8))
    scales = ArrayTensor(r.integers(120, 130, (3, 4), dtype=np.uint8))
    t = Mxfp4(blocks, scales)
    whole = t.materialize()
    np.testing.assert_array_equal(t.read_box(((1, 3), (5, 97))), whole[1:3, 5:97])


@pytest.mark.parametrize("blocks,scales,match", [
    ((2, 4, 8), (2, 4), "expected blocks"),
    ((2, 4, 16), (2, 3), "expected blocks"),
])
def test_mxfp4_refuses_inconsistent_shapes(blocks, scales, match):
    with pytest.raises(FormatError, match=match):
        Mxfp4(ArrayTensor(np.zeros(blocks, np.uint8)), ArrayTensor(np.zeros(scales, np.uint8)))


def test_mxfp4_refuses_other_dtypes():
    with pytest.raises(FormatError, match="expected uint8"):
        Mxfp4(ArrayTensor(np.zeros((2, 16), np.int16)), ArrayTensor(np.zeros((2,), np.uint8)))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq"}, "quantized weights \\('gptq'\\) are not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [True, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [1 << 40, 128]}, "weight_block_size"),
    ("fp8", "expected an object"),
])
def test_bad_quantization_configs_are_one_line(qc, match):
    with pytest.raises(FormatError, match=match):
        hf_quant.quantization({"quantization_config": qc}, "config.json")


def test_unpaired_tensors_are_named():
    q = hf_quant.quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}}, "c")
    with pytest.raises(FormatError, match="fp8 tensors without a _scale_inv scale"):
        hf_quant.dequantize({"a.weight": _fp8((2, 2))}, q, "x")
    with pytest.raises(FormatError, match="which is not in the checkpoint"):
        hf_quant.dequantize({"a.weight_scale_inv": ArrayTensor(np.ones((1, 1), np.float32))}, q, "x")
    with pytest.raises(FormatError, match="not float8_e4m3fn"):
        hf_quant.dequantize({"a.weight": ArrayTensor(np.ones((2, 2), np.float32)),
                             "a.weight_scale_inv": ArrayTensor(np.ones((1, 1), np.float32))}, q, "x")
    mx = hf_quant.quantization({"quantization_config": {"quant_method": "mxfp4"}}, "c")
    with pytest.raises(FormatError, match="has no 'e.down_proj_scales'"):
        hf_quant.dequantize({"e.down_proj_blocks": ArrayTensor(np.zeros((1, 2, 1, 16), np.uint8))}, mx, "x")
