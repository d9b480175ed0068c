"""models/qwen2_moe against transformers' own Qwen2MoeForCausalLM.

Tiny models built by transformers (every parameter random, `hf_parity.build`) and saved by its
`save_pretrained` in this session (the Hub's per-expert names). "qwen2_moe" is the released
layout (every layer MoE, norm_topk_prob false, q/k/v biases, untied); "qwen2_moe_mixed" has
dense layers 0 and 2 (`mlp_only_layers` [0], `decoder_sparse_step` 2) between MoE layers 1 and 3,
norm_topk_prob true, no biases (`qkv_bias` false), tied, head_dim apart from hidden / heads.
Logits: fp32 against transformers' fp32 forward, atol 1e-4, on a mesh with pp=2 and tp, the
experts split over dp too where the devices allow (`meshes.fit` keeps dp first); each
family-specific part dropped or turned off in our config (the shared expert, its sigmoid gate,
the q/k/v biases, norm_topk_prob, a dense layer) moves the logits far off. Import -> restore -> export is bitwise; transformers loads the export back.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from hf_parity import (
    TOKENS,
    assert_far,
    assert_logits,
    build,
    forward,
    load_fp32,
    pp_tp_mesh,
    read_params,
    roundtrip_bitwise,
    torch_logits,
)
from meshes import fit

from hybridckpt import models, naming
from hybridckpt.formats.registry import open_source
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen2_moe.config import Qwen2MoeConfig

SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)  # fmt: skip
MODELS = {
    "qwen2_moe": dict(SIZES),
    "qwen2_moe_mixed": dict(SIZES, num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2,
                            norm_topk_prob=True, qkv_bias=False, tie_word_embeddings=True, head_dim=12),
}  # fmt: skip
SEEDS = {"qwen2_moe": 20, "qwen2_moe_mixed": 22}  # seeds whose routers choose >= 3 expert pairs


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for name, kwargs in MODELS.items():
        m = build("Qwen2MoeForCausalLM", "Qwen2MoeConfig", kwargs, SEEDS[name])
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


def test_saved_names_and_the_groups(hf_dirs):
    """What save_pretrained wrote (the Hub's per-expert names, the shared expert and its gate),
    and where the MoE and dense layers land in the tree."""
    folder, m = hf_dirs["qwen2_moe_mixed"]
    src = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    assert (
        "model.layers.3.mlp.experts.2.up_proj.weight" in src
        and "model.layers.2.mlp.gate_proj.weight" in src
    )
    assert src["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
    assert not any(k.endswith("q_proj.bias") for k in src)
    cfg, params = read_params(folder)
    assert (cfg.moe_layers, cfg.dense_layers) == ((1, 3), (0, 2))
    np.testing.assert_array_equal(
        params["moe"]["shared_gate"]["kernel"][1],
        src["model.layers.3.mlp.shared_expert_gate.weight"].T,
    )
    np.testing.assert_array_equal(
        params["moe"]["shared"]["down"]["kernel"][0],
        src["model.layers.1.mlp.shared_expert.down_proj.weight"].T,
    )
    np.testing.assert_array_equal(
        params["mlp"]["up"]["kernel"][1], src["model.layers.2.mlp.up_proj.weight"].T
    )


@pytest.mark.parametrize("name", MODELS)
def test_top_k_choices_differ_across_tokens(hf_dirs, name):
    _, m = hf_dirs[name]
    with torch.no_grad():
        out = m(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True)
    for layer in out.router_logits:
        chosen = {tuple(sorted(r)) for r in torch.topk(layer, 2, dim=-1).indices.tolist()}
        assert len(chosen) >= 3, chosen


@pytest.mark.parametrize("name, mesh", [("qwen2_moe", "dp=2,tp=2,pp=2"), ("qwen2_moe_mixed", None)])
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    assert_logits(folder, torch_logits(m), mesh=fit(mesh, keep="dp") if mesh else pp_tp_mesh())


def _zeroed(params: dict, group: str, *path: str) -> dict:
    """`params` with the leaf `group.path...` set to zeros (the rest shared)."""

    def put(node, keys):
        if not keys:
            return np.zeros_like(node)
        return node | {keys[0]: put(node[keys[0]], keys[1:])}

    return params | {group: put(params[group], list(path))}


def test_each_qwen2_moe_part_matters(hf_dirs, monkeypatch):
    """Same params: the shared expert left out, added ungated, the q/k/v biases zeroed: the
    logits leave transformers' far behind."""
    folder, m = hf_dirs["qwen2_moe"]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    run = jax.jit(lambda p: models.forward(cfg, p, TOKENS))  # one trace for every params variant
    np.testing.assert_allclose(np.asarray(run(params)), want, atol=1e-4, rtol=0)
    no_bias = _zeroed(
        _zeroed(_zeroed(params, "layers", "q", "bias"), "layers", "k", "bias"),
        "layers",
        "v",
        "bias",
    )
    assert_far(np.asarray(run(no_bias)), want)
    for part in ("shared_expert", "shared_expert_gated"):
        with monkeypatch.context() as mp:
            mp.setattr(Qwen2MoeConfig, part, property(lambda self: False))
            assert_far(forward(cfg, params), want)


def test_norm_topk_prob_and_the_dense_layers_matter(hf_dirs):
    """The mixed model: norm_topk_prob flipped, or a dense layer's MLP zeroed: far off."""
    folder, m = hf_dirs["qwen2_moe_mixed"]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    run = jax.jit(lambda p: models.forward(cfg, p, TOKENS))
    np.testing.assert_allclose(np.asarray(run(params)), want, atol=1e-4, rtol=0)
    assert_far(np.asarray(run(_zeroed(params, "mlp", "down", "kernel"))), want)
    assert_far(forward(dataclasses.replace(cfg, norm_topk_prob=False), params), want)


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    back = load_fp32(out)
    assert type(back) is type(m)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "qkv_bias", "tie_word_embeddings",
                "rope_parameters", "layer_types"):  # fmt: skip
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_transformers_fused_layout_reads_as_the_per_expert_one(hf_dirs, tmp_path):
    """`save_pretrained(save_original_format=False)` (fused `mlp.experts.gate_up_proj`): the
    same tensors under the per-expert names."""
    folder, m = hf_dirs["qwen2_moe"]
    m.save_pretrained(tmp_path, save_original_format=False)
    fused = open_source(str(tmp_path))
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused.tensors
    hub = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    got = {k: v.materialize() for k, v in naming.source_to_hf(fused, fused.config).params.items()}
    assert sorted(got) == sorted(hub)
    for k, want in hub.items():
        assert np.array_equal(got[k], want), k


def test_config_read_and_written(hf_dirs):
    _, m = hf_dirs["qwen2_moe"]
    d = m.config.to_dict()
    for name in MODELS:
        cfg = models.config_from_hf(hf_dirs[name][1].config.to_dict())
        assert type(cfg) is Qwen2MoeConfig and cfg.family == "qwen2_moe"
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    # transformers' defaults where the keys are absent
    bare = {
        k: v
        for k, v in d.items()
        if k not in ("qkv_bias", "norm_topk_prob", "shared_expert_intermediate_size")
    }
    cfg = models.config_from_hf(bare)
    assert cfg.qkv_bias and not cfg.norm_topk_prob and cfg.shared_expert_intermediate_size == 5632
    with pytest.raises(
        ConfigError, match="c.json: Qwen2MoeConfig: no layer is a mixture of experts"
    ):
        models.config_from_hf({**d, "mlp_only_layers": [0, 1]}, source="c.json")
    with pytest.raises(ConfigError, match="c.json: num_experts is 0"):
        models.config_from_hf({**d, "num_experts": 0}, source="c.json")
    with pytest.raises(ConfigError, match="c.json: use_sliding_window=true"):
        models.config_from_hf({**d, "use_sliding_window": True}, source="c.json")
    with pytest.raises(ConfigError, match="mlp_only_layers: expected a list of ints"):
        models.config_from_hf({**d, "mlp_only_layers": ["0"]}, source="c.json")
