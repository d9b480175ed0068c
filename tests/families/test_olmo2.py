"""models/olmo2 against transformers' own Olmo2ForCausalLM.

Tiny models are built and saved by transformers' `save_pretrained` in this session (the real
tool writes the fixture: fp32 safetensors and its config.json), every parameter random
(`hf_parity.build`). Logits: fp32 against transformers' fp32 forward, atol 1e-4, on a mesh with
pp=2 and tp=4 (fewer devices: the largest of that form). Each OLMo 2 fact (post-norms only, q/k
RMSNorm over the whole projection) turned off in our config moves the logits far from
transformers'. Import -> restore -> export is bitwise, and transformers loads the export back.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_parity import (
    assert_far,
    assert_logits,
    build,
    forward,
    load_fp32,
    read_params,
    roundtrip_bitwise,
    torch_logits,
)

from hybridckpt import models
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.olmo2.config import Olmo2Config

SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
MODELS = {
    "olmo2": dict(SIZES, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "olmo2_tied": dict(SIZES, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, kwargs) in enumerate(MODELS.items()):
        m = build("Olmo2ForCausalLM", "Olmo2Config", kwargs, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    assert_logits(folder, torch_logits(m))


@pytest.mark.parametrize("fact", ["post_norms", "qk_norm_whole"])
def test_each_olmo2_fact_matters(hf_dirs, monkeypatch, fact):
    """Same params, the fact turned off in our config (norms before the sublayers; q/k norms
    per head): the logits leave transformers' far behind."""
    folder, m = hf_dirs["olmo2"]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    np.testing.assert_allclose(forward(cfg, params), want, atol=1e-4, rtol=0)
    monkeypatch.setattr(Olmo2Config, fact, property(lambda self: False))
    assert_far(forward(cfg, params), want)


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    back = load_fp32(out)
    assert type(back) is type(m)
    for key in ("tie_word_embeddings", "num_key_value_heads", "rms_norm_eps", "rope_parameters"):
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_config_read_and_written(hf_dirs):
    folder, m = hf_dirs["olmo2"]
    cfg = models.config_from_hf(m.config.to_dict())
    assert type(cfg) is Olmo2Config and cfg.family == "olmo2"
    assert (cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps) == (8, 5000.0, 1e-5)
    assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    d = m.config.to_dict()
    del d["rms_norm_eps"]  # transformers' Olmo2Config default, not Llama's 1e-6
    assert models.config_from_hf(d).rms_norm_eps == 1e-5
    with pytest.raises(ConfigError, match="c.json: attention_bias=true is not supported"):
        models.config_from_hf({**m.config.to_dict(), "attention_bias": True}, source="c.json")


def test_param_tree():
    cfg = models.config_from_hf(
        build("Olmo2ForCausalLM", "Olmo2Config", MODELS["olmo2"], 0).config.to_dict()
    )
    shapes, axes = models.param_shape_tree(cfg), models.param_axes_tree(cfg)
    assert shapes["layers"]["q_norm"]["scale"] == (2, 32) and axes["layers"]["q_norm"]["scale"] == (
        "layers",
        "heads",
    )
    assert shapes["layers"]["k_norm"]["scale"] == (2, 16)
    assert {"attn_norm", "mlp_norm"}.isdisjoint(shapes["layers"])
    assert {"post_attn_norm", "post_mlp_norm"} <= set(shapes["layers"])
