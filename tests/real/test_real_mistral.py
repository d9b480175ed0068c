"""Mistral's native layout (`params.json` + `consolidated.safetensors`) written from mistral-inference's
own Transformer and read back by its own `from_folder` (`generators/mistral.py`): a dense Mistral
with a sliding window shorter than the tokens and head_dim apart from dim / n_heads, and Mixtral
(`moe` in params.json).

Params: bit for bit against the weights in HF names (transformers' converters' names and
permute_for_rope), from the reader and after import on a mesh, restore on another and export.
Logits: our forward against mistral-inference's (prefill with its BufferCache), fp32, max abs gap
1e-5 (logits are of order one; transformers' forward differs from mistral-inference's by ~3e-6).
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

CASES = ["mistral_swa", "mixtral_moe"]
LOGITS_ATOL = 1e-5


def _weights(ref: dict) -> dict:
    return {k: v for k, v in ref.items() if k not in ("logits", "tokens")}


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_the_model_bit_for_bit(case):
    path, hc = ckpt(case), manifest(case)["hf_config"]
    assert detect(path) == "meta-llama"
    src = open_source(path)
    hf = parse_rules(src.hf_rules, src.rule_vars).apply(src.tensors).tensors
    want = _weights(reference(case))
    assert sorted(hf) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(hf[k].materialize(), v), k
    cfg = src.config
    assert cfg.family == ("mixtral" if "num_local_experts" in hc else "mistral")
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size, cfg.sliding_window, cfg.rope_theta) == (
        hc["head_dim"], hc["num_key_value_heads"], hc["intermediate_size"], hc["sliding_window"], hc["rope_theta"])


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_mistral_inference(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=mesh_pair()[0])
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", CASES)
def test_import_restore_export_bitwise(case, tmp_path):
    params, _, _, _ = import_export(ckpt(case), tmp_path, optimizer=False)
    want = _weights(reference(case))
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], v), k


@pytest.mark.parametrize(
    "case,edit",
    [("mistral_swa", {"sliding_window": None}), ("mixtral_moe", {"moe": {"num_experts": 4, "num_experts_per_tok": 1}})],
    ids=["no_window", "top1"],
)
def test_params_json_matters(case, edit, tmp_path):
    """Negative controls: without the sliding window, or routing to one expert instead of two,
    the logits leave the tolerance, so the logits test checks both."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt(case), copy)
    params = json.loads((copy / "params.json").read_text())
    params.update(edit)
    (copy / "params.json").write_text(json.dumps(params))
    ref = reference(case)
    got = jobs.logits(str(copy), ref["tokens"], mesh="dp=1")
    assert np.abs(got - ref["logits"]).max() > 100 * LOGITS_ATOL
