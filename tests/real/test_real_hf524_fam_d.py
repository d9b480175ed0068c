"""Qwen3-VL, Qwen2.5-VL and Qwen3-Next as transformers 5.24's `save_pretrained` wrote them
(`generators/hf524_fam_d.py`, bf16): Qwen3-VL tied with the module names
(`model.language_model.*`, `model.visual.*`, one DeepStack merger), Qwen2.5-VL untied with the
released names (`model.*`, `visual.*`), Qwen3-Next with transformers' default 3:1 layer pattern
and per-expert names.

Params from the reader equal transformers' own (its state dict read back, fp32 of the stored bf16)
and stay bf16; import onto `dp=1,fsdp=2,tp=2,pp=2` (fitted to the devices present), restore on
another mesh (Qwen3-Next: import and export), export: every tensor bit for bit under its name,
the vision tower included; logits against transformers' recorded forward (fp32, atol 1e-4) text
only, and given the recorded 3-axis position ids (M-RoPE: interleaved for Qwen3-VL, chunked for
Qwen2.5-VL).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from cases import ckpt, reference
from e2e import roundtrip
from roundtrip_real import bitwise_equal

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source

VL_CASES = {"hf524_qwen3_vl": "qwen3_vl", "hf524_qwen2_5_vl": "qwen2_5_vl"}
CASES = {**VL_CASES, "hf524_qwen3_next": "qwen3_next"}
PREFIXES = {"hf524_qwen3_vl": ("model.language_model.", "model.visual."), "hf524_qwen2_5_vl": ("model.", "visual.")}
REFS = ("logits", "tokens", "logits_mrope", "position_ids")
ATOL = 1e-4


def _weights(ref: dict) -> dict:
    return {k: v for k, v in ref.items() if k not in REFS}


def _mesh() -> str:
    n = jax.device_count()
    return "dp=1,fsdp=2,tp=2,pp=2" if n >= 8 else "tp=2,pp=2" if n >= 4 else "pp=2" if n >= 2 else "dp=1"


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_transformers_tensors_and_the_family(case):
    src = open_source(ckpt(case))
    want = _weights(reference(case))
    assert sorted(src.tensors) == sorted(want)
    for k, v in want.items():
        got = src.tensors[k].materialize()
        assert got.dtype.name == "bfloat16" and np.array_equal(got.astype(np.float32), v), k
    cfg = jobs.open_checkpoint(ckpt(case)).config
    assert cfg.family == CASES[case] and cfg.tie_word_embeddings == (case == "hf524_qwen3_vl")
    if case in VL_CASES:
        assert (cfg.text_prefix, cfg.vision_prefix) == PREFIXES[case]
    else:  # transformers' default pattern and rotary fraction
        assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.rotary_dim == 2


@pytest.mark.parametrize("case", VL_CASES)
def test_import_restore_export_bitwise(case, tmp_path):
    params, *_ = roundtrip(ckpt(case), str(tmp_path), mesh_a=_mesh(), mesh_b="dp=2,tp=4", optimizer=False)
    source = {k: v.materialize() for k, v in open_source(ckpt(case)).tensors.items()}
    assert sorted(params) == sorted(source)
    for k, v in source.items():
        assert bitwise_equal(params[k], v), k


def test_qwen3_next_import_export_bitwise(tmp_path):
    """Imported onto the mesh (its one full-attention layer replicated over pp, which cannot
    split a stack of one), exported: every tensor bit for bit."""
    case = "hf524_qwen3_next"
    store, out = str(tmp_path / "orbax"), str(tmp_path / "exported")
    jobs.import_checkpoint(ckpt(case), store, mesh=_mesh())
    jobs.export_checkpoint(store, out, optimizer=False)
    params = {k: v.materialize() for k, v in open_source(out).tensors.items()}
    source = {k: v.materialize() for k, v in open_source(ckpt(case)).tensors.items()}
    assert sorted(params) == sorted(source)
    for k, v in source.items():
        assert bitwise_equal(params[k], v), k


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case):
    ref = reference(case)
    np.testing.assert_allclose(jobs.logits(ckpt(case), ref["tokens"], mesh=_mesh()), ref["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", VL_CASES)
def test_mrope_logits_equal_transformers(case):
    """Given transformers' 3-axis position ids, our module's logits are its recorded ones (and far
    from the text-only logits: the ids matter)."""
    ref = reference(case)
    opened = jobs.open_checkpoint(ckpt(case))
    tree = naming.hf_to_tree(opened.named, opened.config).params
    params = naming.nest({k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()})
    got = models.module(opened.config).apply({"params": params}, ref["tokens"], ref["position_ids"])
    np.testing.assert_allclose(np.asarray(got), ref["logits_mrope"], rtol=0, atol=ATOL)
    assert np.abs(ref["logits_mrope"] - ref["logits"]).max() > 100 * ATOL
