"""Meta Llama checkpoints written by Meta's own Transformer under fairscale model parallel
(`generators/meta_llama.py`): Llama 2 (meta-llama/llama model.py, GQA, ParallelEmbedding) and
Llama 3.1 (llama-models, VocabParallelEmbedding, `use_scaled_rope`), on 1 and 2 ranks.

Params: bit for bit against the 1-rank model in HF names (convert_llama_weights_to_hf.py's names
and permute), straight from the reader and after import on a mesh, restore on another and export.
Logits: our forward of the imported checkpoint against Meta's forward, fp32, max abs gap 1e-5
(logits are of order one; Meta vs transformers' LlamaForCausalLM differ by ~2e-6, the manifest says).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cases import ckpt, manifest, reference
from roundtrip_real import bitwise_equal, import_export, mesh_pair

from hybridckpt import jobs
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.rules import parse_rules

CASES = ["meta_llama2_gqa_mp1", "meta_llama2_gqa_mp2", "meta_llama31_mp1", "meta_llama31_mp2"]
LOGITS_ATOL = 1e-5


def _weights(ref: dict) -> dict:
    return {k: v for k, v in ref.items() if k not in ("logits", "tokens")}


def _hf(src) -> dict:
    return {k: t.materialize() for k, t in parse_rules(src.hf_rules, src.rule_vars).apply(src.tensors).tensors.items()}


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_the_model_bit_for_bit(case):
    path, m = ckpt(case), manifest(case)
    assert detect(path) == "meta-llama"
    src = open_source(path)
    assert src.topology == {"tp": m["model_parallel"]}
    # Llama 2's ParallelEmbedding splits the embedding dim, Llama 3's VocabParallelEmbedding the vocab
    split_dim = m["params_json"].get("rope_theta") is None and m["model_parallel"] > 1
    assert src.rule_vars["vocab_parallel"] is not split_dim
    hf, want = _hf(src), _weights(reference(case))
    assert sorted(hf) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(hf[k], v), k
    cfg, hc = src.config, m["hf_config"]
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.num_kv_heads) == (
        hc["vocab_size"], hc["intermediate_size"], hc["num_key_value_heads"])
    assert cfg.rope_theta == hc["rope_theta"]
    assert (dict(cfg.rope_scaling) if cfg.rope_scaling else None) == hc["rope_scaling"]


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_metas_forward(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=mesh_pair()[0])
    assert got.shape == ref["logits"].shape
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", ["meta_llama2_gqa_mp2", "meta_llama31_mp2"])
def test_import_restore_export_bitwise(case, tmp_path):
    params, _, _, _ = import_export(ckpt(case), tmp_path, optimizer=False)
    want = _weights(reference(case))
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], v), k


def test_scaled_rope_matters(tmp_path):
    """Negative control: the Llama 3.1 checkpoint read without `use_scaled_rope` gives logits
    outside the tolerance, so the logits test checks the llama3 RoPE scaling."""
    case = "meta_llama31_mp2"
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt(case), copy)
    params = json.loads((copy / "params.json").read_text())
    params["use_scaled_rope"] = False
    (copy / "params.json").write_text(json.dumps(params))
    ref = reference(case)
    got = jobs.logits(str(copy), ref["tokens"], mesh="dp=1")
    assert np.abs(got - ref["logits"]).max() > 100 * LOGITS_ATOL


def test_shard_order_matters(tmp_path):
    """Negative control: ranks swapped (consolidated.00 <-> .01) give other params and logits."""
    case = "meta_llama31_mp2"
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt(case), copy)
    (copy / "consolidated.00.pth").rename(copy / "tmp.pth")
    (copy / "consolidated.01.pth").rename(copy / "consolidated.00.pth")
    (copy / "tmp.pth").rename(copy / "consolidated.01.pth")
    hf, want = _hf(open_source(str(copy))), _weights(reference(case))
    assert not bitwise_equal(hf["model.layers.0.self_attn.q_proj.weight"], want["model.layers.0.self_attn.q_proj.weight"])
    ref = reference(case)
    got = jobs.logits(str(copy), ref["tokens"], mesh="dp=1")
    assert np.abs(got - ref["logits"]).max() > 100 * LOGITS_ATOL
