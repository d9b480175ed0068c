"""models/smollm3 against transformers' own SmolLM3ForCausalLM.

Tiny models built by transformers (every parameter random, `hf_parity.build`) and saved by its
`save_pretrained` in this session: "smollm3" as released (tied, NoPE every 4th layer: 4 layers,
layer 3 NoPE), "smollm3_untied_list" with an explicit `no_rope_layers` list (layers 0 and 2
NoPE), untied, head_dim apart from hidden / heads. Logits: fp32 against transformers' fp32
forward, atol 1e-4, on a mesh with pp=2 and tp (the largest the devices allow). The NoPE layers
turned into RoPE layers in our config move the logits far from transformers'. Import -> restore
-> export is bitwise, and transformers loads the export back.
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
from hybridckpt.models.smollm3.config import SmolLM3Config

SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0}, pad_token_id=None, bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip
MODELS = {
    "smollm3": dict(SIZES),
    "smollm3_untied_list": dict(
        SIZES, tie_word_embeddings=False, no_rope_layers=[0, 1, 0, 1], head_dim=12
    ),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, kwargs) in enumerate(MODELS.items()):
        m = build("SmolLM3ForCausalLM", "SmolLM3Config", kwargs, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    assert_logits(folder, torch_logits(m))


def test_the_nope_layers_matter(hf_dirs):
    """Same params, every layer given RoPE in our config: far from transformers'."""
    folder, m = hf_dirs["smollm3_untied_list"]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    assert cfg.use_rope_layers == tuple(bool(f) for f in m.config.no_rope_layers)
    assert False in cfg.use_rope_layers
    np.testing.assert_allclose(forward(cfg, params), want, atol=1e-4, rtol=0)
    assert_far(
        forward(dataclasses.replace(cfg, no_rope_layers=(1,) * cfg.num_layers), params), want
    )


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    back = load_fp32(out)
    assert type(back) is type(m)
    for key in (
        "tie_word_embeddings",
        "no_rope_layers",
        "num_key_value_heads",
        "rope_parameters",
        "layer_types",
    ):
        assert getattr(back.config, key) == getattr(m.config, key), key
    assert getattr(back.config, "head_dim", 8) == getattr(m.config, "head_dim", 8)
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_config_read_and_written(hf_dirs):
    _, m = hf_dirs["smollm3"]
    d = m.config.to_dict()
    cfg = models.config_from_hf(d)
    assert type(cfg) is SmolLM3Config and cfg.family == "smollm3"
    assert cfg.use_rope_layers == (True, True, True, False) and cfg.tie_word_embeddings
    assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    # transformers' defaults where the keys are absent: tied, NoPE from the interval, theta 2e6
    sparse = {
        k: v
        for k, v in d.items()
        if k not in ("tie_word_embeddings", "no_rope_layers", "rope_parameters")
    }
    cfg = models.config_from_hf(dict(sparse, num_hidden_layers=8, no_rope_layer_interval=3))
    assert cfg.tie_word_embeddings and cfg.rope_theta == 2e6
    assert [i for i, r in enumerate(cfg.use_rope_layers) if not r] == [2, 5]
    assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
    # the flags are made when asked, not when read: 2**31 layers build no list (a config is data)
    huge = models.config_from_hf(dict(sparse, num_hidden_layers=2**31), source="c.json")
    assert huge.no_rope_layers == () and huge.num_layers == 2**31
    with pytest.raises(ConfigError, match="c.json: .*no_rope_layers: 3 entries for 4 layers"):
        models.config_from_hf({**d, "no_rope_layers": [1, 1, 0]}, source="c.json")
    with pytest.raises(ConfigError, match="no_rope_layers: expected a list of 0 and 1"):
        models.config_from_hf({**d, "no_rope_layers": [1, 2, 1, 1]}, source="c.json")
    with pytest.raises(ConfigError, match="c.json: use_sliding_window=true"):
        models.config_from_hf(
            {**d, "use_sliding_window": True, "sliding_window": 4}, source="c.json"
        )
