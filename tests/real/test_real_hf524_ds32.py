"""DeepSeek V3.2 as transformers 5.24's `save_pretrained` wrote it (`generators/hf524_ds32.py`):
`hf524_deepseek_v32`, a DeepseekV32ForCausalLM cast to bf16 and saved (every tensor bf16, the
routers' too), 2 dense + 2 MoE layers, q LoRA, yarn, the lightning indexer keeping
4 of up to 12 keys.

Params bit for bit from the reader (in their stored dtype) and after import onto
dp=1,fsdp=2,tp=2,pp=2 (the largest mesh of that form the devices allow), restore onto another
mesh and export; logits against the transformers logits recorded with the case (its fp32 load,
atol 1e-4) on that mesh; the export loads back as the same family.
"""

from __future__ import annotations

import numpy as np
from cases import ckpt, reference
from roundtrip_real import bitwise_equal, import_export

from hybridckpt import jobs
from hybridckpt.formats.registry import open_source

CASE = "hf524_deepseek_v32"
LOGITS_ATOL = 1e-4


def _mesh() -> str:
    from meshes import fit

    return fit("dp=1,fsdp=2,tp=2,pp=2")


def _weights() -> dict:
    return {k: v for k, v in reference(CASE).items() if k not in ("logits", "tokens")}


def _as_reference(got: np.ndarray, name: str) -> np.ndarray:
    """`got` in its stored dtype (checked) as the reference holds it: bf16 widened exactly."""
    assert np.asarray(got).dtype.name == "bfloat16", (name, got.dtype)
    return np.asarray(got).astype(np.float32)


def test_reader_gives_the_tensors_bit_for_bit():
    src = open_source(ckpt(CASE))
    want = _weights()
    assert sorted(src.tensors) == sorted(want)
    assert "model.layers.3.self_attn.indexer.weights_proj.weight" in want
    for k, v in want.items():
        assert bitwise_equal(_as_reference(src.tensors[k].materialize(), k), v), k


def test_config_is_read_as_the_family():
    cfg = jobs.open_checkpoint(ckpt(CASE)).config
    assert cfg.family == "deepseek_v32"
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads) == (4, 8, 4)
    assert (cfg.num_dense_layers, cfg.num_moe_layers, cfg.q_lora_rank, cfg.mtp_layers) == (
        2,
        2,
        8,
        0,
    )
    assert dict(cfg.rope_scaling)["rope_type"] == "yarn"


def test_import_restore_export_bitwise(tmp_path):
    params, _, _, _ = import_export(ckpt(CASE), tmp_path, optimizer=False)
    src = open_source(ckpt(CASE))
    want = _weights()
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], src.tensors[k].materialize()), k
        assert bitwise_equal(_as_reference(params[k], k), v), k
    assert (
        jobs.open_checkpoint(str(tmp_path / "exported")).config
        == jobs.open_checkpoint(ckpt(CASE)).config
    )


def test_logits_equal_transformers():
    ref = reference(CASE)
    got = jobs.logits(ckpt(CASE), ref["tokens"], mesh=_mesh())
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)
