"""models/phi3 (Phi-3, Phi-3.5, Phi-4, Phi-4-mini) against transformers' own Phi3ForCausalLM.

Tiny models built and saved by transformers' `save_pretrained` in this session (the real tool
writes the fixture), every parameter random (`hf_parity.build`):
- "phi3": GQA, partial rotary 0.5, longrope with the forward (8 tokens) longer than
  original_max_position_embeddings 4 (the long factors and an attention factor from
  max_position / original), a sliding window of 5;
- "phi4_mini": Phi-4-mini's shape of options: tied head, partial rotary 0.75 (6 of 8 dims),
  plain RoPE;
- "phi3_short": longrope within the original length (the short factors), full rotary, factor
  and attention factor given.
Logits: fp32 against transformers' fp32 forward, atol 1e-4, on a mesh with pp=2 and tp=4 (fewer
devices: the largest of that form). Each Phi-3 part turned off (in our config, or the fused
tensor read another way) moves the logits far from transformers'. Import -> restore -> export
is bitwise (the fused tensors included), transformers loads the export back.
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
from hybridckpt.models.phi3.config import Phi3Config

SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    pad_token_id=None, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
LONG = {
    "rope_type": "longrope",
    "rope_theta": 5000.0,
    "short_factor": [1.0, 2.5],
    "long_factor": [3.0, 7.0],
}
MODELS = {
    "phi3": dict(SIZES, original_max_position_embeddings=4, partial_rotary_factor=0.5,
                 rope_parameters=LONG, sliding_window=5),
    "phi4_mini": dict(SIZES, num_key_value_heads=4, tie_word_embeddings=True, partial_rotary_factor=0.75),
    "phi3_short": dict(SIZES, original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "short_factor": [1.5, 1.0, 4.0, 2.0], "long_factor": [9.0] * 4,
        "factor": 4.0, "attention_factor": 1.3}),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, kwargs) in enumerate(MODELS.items()):
        m = build("Phi3ForCausalLM", "Phi3Config", kwargs, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    assert_logits(folder, torch_logits(m))


def _swap(params: dict, leaf: str, swap) -> dict:
    layers = {k: dict(v) for k, v in params["layers"].items()}
    layers[leaf]["kernel"] = swap(layers[leaf]["kernel"])
    return {**params, "layers": layers}


CHANGES = {
    # longrope off: plain RoPE of the same theta (no factors, no attention factor)
    "longrope": ("phi3", lambda c: dataclasses.replace(c, longrope=None), None),
    # the short factors where the forward is longer than the original length
    "long_factor": ("phi3", lambda c: dataclasses.replace(c, original_max_position_embeddings=8), None),
    "short_factor": ("phi3_short", lambda c: dataclasses.replace(c, longrope=(("long_factor", (1.0,) * 4), ("short_factor", (1.0,) * 4))), None),
    "partial_rotary": ("phi4_mini", lambda c: dataclasses.replace(c, partial_rotary_factor=1.0), None),
    "sliding_window": ("phi3", lambda c: dataclasses.replace(c, sliding_window=None), None),
    # the fused tensors read another way: up | gate, or q | v | k
    "gate_up_order": ("phi3", None, ("gate_up", lambda k: k[..., ::-1, :])),
    "qkv_order": ("phi3", None, ("qkv", lambda k: np.concatenate([k[..., :32], k[..., 48:], k[..., 32:48]], -1))),
}  # fmt: skip


@pytest.mark.parametrize("part", CHANGES)
def test_each_phi3_part_matters(hf_dirs, part):
    """Same checkpoint, one Phi-3 part off in our config (or the fused tensor split another
    way): the logits leave transformers' far behind."""
    name, change_cfg, change_params = CHANGES[part]
    folder, m = hf_dirs[name]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    np.testing.assert_allclose(forward(cfg, params), want, atol=1e-4, rtol=0)
    if change_cfg is not None:
        cfg = change_cfg(cfg)
    if change_params is not None:
        params = _swap(params, *change_params)
    assert_far(forward(cfg, params), want)


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    # the export's config.json is ours (`config_to_hf`): no token ids, so transformers' Phi-3
    # default pad_token_id 32000 would not fit this vocabulary of 96
    back = load_fp32(out, pad_token_id=None)
    assert type(back) is type(m)
    for key in ("tie_word_embeddings", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
                "original_max_position_embeddings", "sliding_window"):  # fmt: skip
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_config_read_and_written(hf_dirs):
    cfgs = [models.config_from_hf(hf_dirs[name][1].config.to_dict()) for name in MODELS]
    assert all(type(c) is Phi3Config and c.family == "phi3" for c in cfgs)
    phi3, phi4, short = cfgs
    assert (phi3.rotary_dim, phi3.sliding_window, phi3.original_max_position_embeddings) == (
        4,
        5,
        4,
    )
    assert dict(phi3.longrope) == {"short_factor": (1.0, 2.5), "long_factor": (3.0, 7.0)}
    assert (phi4.rotary_dim, phi4.longrope, phi4.tie_word_embeddings) == (6, None, True)
    assert dict(short.longrope)["attention_factor"] == 1.3
    for cfg in cfgs:
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    # transformers 4's spelling: rope_scaling type "su", rope_theta and the factor top-level
    v4 = {**hf_dirs["phi3"][1].config.to_dict(), "rope_parameters": None, "rope_theta": 5000.0,
          "rope_scaling": {"type": "su", "short_factor": [1.0, 2.5], "long_factor": [3.0, 7.0]}}  # fmt: skip
    assert models.config_from_hf(v4) == phi3


def test_bad_configs_are_refused(hf_dirs):
    d = hf_dirs["phi3"][1].config.to_dict()
    rope = d["rope_parameters"]
    with pytest.raises(
        ConfigError, match="c.json: rope_parameters rope_type 'linear' is not supported by Phi-3"
    ):
        models.config_from_hf(
            {**d, "rope_parameters": {**rope, "rope_type": "linear"}}, source="c.json"
        )
    with pytest.raises(ConfigError, match=r"c.json: .*long_factor must be 2 positive numbers"):
        models.config_from_hf(
            {**d, "rope_parameters": {**rope, "long_factor": [1.0]}}, source="c.json"
        )
    with pytest.raises(ConfigError, match=r"c.json: .*rotary dims 3 .* must be even"):
        models.config_from_hf(
            {**d, "rope_parameters": {**rope, "partial_rotary_factor": 0.375}}, source="c.json"
        )


def test_param_tree(hf_dirs):
    cfg = models.config_from_hf(hf_dirs["phi3"][1].config.to_dict())
    shapes, axes = models.param_shape_tree(cfg), models.param_axes_tree(cfg)
    assert shapes["layers"]["qkv"]["kernel"] == (2, 32, 32 + 2 * 16)
    assert shapes["layers"]["gate_up"]["kernel"] == (2, 32, 2, 64)
    assert axes["layers"]["gate_up"]["kernel"] == ("layers", "embed", None, "mlp")
    assert {"q", "k", "v", "gate", "up"}.isdisjoint(shapes["layers"])
