"""Llama 4 as transformers 5.24's `save_pretrained` wrote it (`generators/hf524_llama4.py`):
`hf524_llama4` (Llama4ForCausalLM, fp32: interleaved MoE / dense layers, NoPE layers with
temperature tuning, chunked attention crossed by the sequence, q/k norm, llama3 RoPE) and
`hf524_llama4_mm` (Llama4ForConditionalGeneration in bf16: Scout's RoPE, the vision tower and
projector carried).

Params bit for bit from the reader (in their stored dtype) and after import onto
dp=1,fsdp=2,tp=2,pp=2 (the largest mesh of that form the devices allow), restore onto another
mesh and export (the vision tower and projector under the names read); logits against the
transformers logits recorded with the case (fp32, atol 1e-4) on that mesh.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import ckpt, reference
from roundtrip_real import bitwise_equal, import_export

from hybridckpt import jobs
from hybridckpt.formats.registry import open_source

CASES = {"hf524_llama4": "float32", "hf524_llama4_mm": "bfloat16"}  # case -> stored dtype
LOGITS_ATOL = 1e-4


def _mesh() -> str:
    from meshes import fit

    return fit("fsdp=2,tp=2,pp=2")


def _weights(case: str) -> dict:
    return {k: v for k, v in reference(case).items() if k not in ("logits", "tokens")}


def _as_stored(got: np.ndarray, case: str) -> np.ndarray:
    """`got` (the stored dtype) as the reference holds it: bf16 widened to fp32 exactly."""
    assert np.asarray(got).dtype.name == CASES[case], (case, got.dtype)
    return np.asarray(got).astype(np.float32)


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_the_tensors_bit_for_bit(case):
    src = open_source(ckpt(case))
    want = _weights(case)
    assert sorted(src.tensors) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(_as_stored(src.tensors[k].materialize(), case), v), k


def test_configs_are_read_as_the_families():
    cfg = jobs.open_checkpoint(ckpt("hf524_llama4")).config
    assert cfg.family == "llama4"
    assert (cfg.moe_layers, cfg.dense_layers, cfg.rope_layers) == ((1, 3), (0, 2), (True, False, True, False))
    assert cfg.chunked_layers == (True, False, True, False) and cfg.attention_chunk_size == 5
    assert (cfg.use_qk_norm, cfg.floor_scale, cfg.attn_scale) == (True, 4, 0.5)
    mm = jobs.open_checkpoint(ckpt("hf524_llama4_mm")).config
    assert mm.family == "llama4_mm" and mm.moe_layers == (0, 1, 2, 3) and not mm.use_qk_norm
    assert dict(mm.rope_scaling)["high_freq_factor"] == dict(mm.rope_scaling)["low_freq_factor"] == 1.0
    assert (mm.vision_num_layers, mm.vision_positions, mm.projector_output_dim) == (1, 5, 16)


@pytest.mark.parametrize("case", CASES)
def test_import_restore_export_bitwise(case, tmp_path):
    params, _, _, _ = import_export(ckpt(case), tmp_path, optimizer=False)
    src = open_source(ckpt(case))
    want = _weights(case)
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], src.tensors[k].materialize()), k
        assert bitwise_equal(_as_stored(params[k], case), v), k


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=_mesh())
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)
