"""models/granite against transformers' own GraniteForCausalLM.

Tiny models built and saved by transformers' `save_pretrained` in this session (the real tool
writes the fixture), every parameter random (`hf_parity.build`), the four Granite scalars set
away from 1 as the releases do. Logits: fp32 against transformers' fp32 forward, atol 1e-4, on a
mesh with pp=2 and tp=4 (fewer devices: the largest of that form). Each scalar set back to its
neutral value in our config (1; head_dim ** -0.5 for the attention scale) moves the logits far
from transformers'. Import -> restore -> export is bitwise, transformers loads the export back.
"""

from __future__ import annotations

import dataclasses

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
from hybridckpt.models.granite.config import GraniteConfig

SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
# granite-3.x-2b sets 12, 0.22, 0.0078125 (1/128, its head_dim) and 8; the attention scale here
# is 1.0 (transformers' default), far from head_dim ** -0.5, so it shows on a tiny model
SCALARS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.0,
               logits_scaling=8.0)  # fmt: skip
MODELS = {
    "granite": dict(SIZES, **SCALARS),
    "granite_tied": dict(SIZES, **SCALARS, tie_word_embeddings=True),
}
NEUTRAL = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 8**-0.5,
    "logits_scaling": 1.0,
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, kwargs) in enumerate(MODELS.items()):
        m = build("GraniteForCausalLM", "GraniteConfig", kwargs, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    assert_logits(folder, torch_logits(m))


@pytest.mark.parametrize("scalar", NEUTRAL)
def test_each_granite_scalar_matters(hf_dirs, scalar):
    """Same params, one scalar neutral in our config: far from transformers' logits."""
    folder, m = hf_dirs["granite"]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    assert getattr(cfg, scalar) == SCALARS[scalar]
    np.testing.assert_allclose(forward(cfg, params), want, atol=1e-4, rtol=0)
    assert_far(forward(dataclasses.replace(cfg, **{scalar: NEUTRAL[scalar]}), params), want)


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    back = load_fp32(out)
    assert type(back) is type(m)
    for key in (
        "tie_word_embeddings",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_parameters",
        *SCALARS,
    ):
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_config_read_and_written(hf_dirs):
    _, m = hf_dirs["granite"]
    d = m.config.to_dict()
    cfg = models.config_from_hf(d)
    assert type(cfg) is GraniteConfig and cfg.family == "granite"
    assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    assert models.param_shape_tree(cfg) == models.param_shape_tree(
        models.LlamaConfig(
            **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(models.LlamaConfig)}
        )
    )
    bare = {k: v for k, v in d.items() if k not in SCALARS}
    assert {k: getattr(models.config_from_hf(bare), k) for k in SCALARS} == dict.fromkeys(
        SCALARS, 1.0
    )
    with pytest.raises(
        ConfigError, match="c.json: logits_scaling must be a positive number, found 0"
    ):
        models.config_from_hf({**d, "logits_scaling": 0}, source="c.json")
