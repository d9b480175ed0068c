"""models/qwen3_next: Qwen3-Next (`Qwen3NextForCausalLM`) against transformers' own model.

Tiny models built by transformers (every parameter random, `hf_parity.build`; A_log drawn so the
decay is real) and saved by its `save_pretrained` in this session: three linear-attention
layers then one full-attention layer (the released 3:1 pattern), value heads twice the key
heads; and one with a dense layer, a tied head and full attention first.

Checked: the delta rule (`lax.scan`) equals transformers' two torch reference kernels
(`torch_chunk_gated_delta_rule` over several chunks, `torch_recurrent_gated_delta_rule`);
logits (fp32, atol 1e-4) on a mesh with pp=2 and tp against transformers' forward; each part of
the family shown to move the logits far off when dropped (the attention output gate, partial
rotary, the (1+w) norms, the causal conv, the per-key-head grouping of `in_proj_qkvz` /
`in_proj_ba`, the decay, the gated norm's silu(z), the shared expert's sigmoid gate); import ->
restore -> export bitwise, loaded back by transformers; experts over the experts axis, heads
split on head boundaries.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_parity import (
    TOKENS,
    assert_far,
    assert_logits,
    build,
    read_params,
    roundtrip_bitwise,
    torch_logits,
)
from transformers.models.qwen3_next import modeling_qwen3_next as theirs

from hybridckpt import jobs, models
from hybridckpt.formats.registry import open_source
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen3_next import delta, module
from hybridckpt.models.qwen3_next.config import Qwen3NextConfig

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=6,
            moe_intermediate_size=8, shared_expert_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})  # fmt: skip
MODELS = {
    "hybrid": dict(BASE, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                   layer_types=["linear_attention", "full_attention"] * 2),
    "dense_layer_tied": dict(BASE, num_hidden_layers=2, linear_num_key_heads=1, linear_num_value_heads=2,
                             layer_types=["full_attention", "linear_attention"], mlp_only_layers=[1],
                             tie_word_embeddings=True),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for seed, (name, kwargs) in enumerate(MODELS.items()):
        m = build("Qwen3NextForCausalLM", "Qwen3NextConfig", kwargs, seed)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("A_log"):
                    p.normal_(-1.0, 0.5)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


def test_the_delta_rule_equals_transformers_kernels():
    """Our scan against both torch reference kernels: 70 tokens (two chunks of 64), 2 key heads
    serving 4 value heads, q/k L2-normalised in the kernel."""
    g = torch.Generator().manual_seed(0)
    b, s, nk, nv, dk, dv = 2, 70, 2, 4, 8, 6
    q, k = torch.randn(b, s, nk, dk, generator=g), torch.randn(b, s, nk, dk, generator=g)
    v = torch.randn(b, s, nv, dv, generator=g)
    decay = -torch.rand(b, s, nv, generator=g)
    beta = torch.rand(b, s, nv, generator=g)
    ours = np.asarray(delta.delta_rule(*(jnp.asarray(t.numpy()) for t in (q, k, v, decay, beta))))
    for kernel in (theirs.torch_chunk_gated_delta_rule, theirs.torch_recurrent_gated_delta_rule):
        want, _ = kernel(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(ours, want.numpy(), atol=2e-5, rtol=0)
    no_decay = np.asarray(
        delta.delta_rule(*(jnp.asarray(t.numpy()) for t in (q, k, v, 0 * decay, beta)))
    )
    assert np.abs(no_decay - ours).max() > 1e-2


def test_saved_names_are_per_expert_and_grouped_by_kind(hf_dirs):
    folder, _ = hf_dirs["hybrid"]
    names = set(jobs.open_checkpoint(folder).named.params)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert "model.layers.3.linear_attn.A_log" not in names
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.2.mlp.shared_expert_gate.weight" in names
    cfg, params = read_params(folder)
    assert (cfg.attention_layers, cfg.linear_layers, cfg.rotary_dim) == ((1, 3), (0, 2), 4)
    assert params["linear"]["qkvz"]["kernel"].shape == (2, 32, 2 * (2 * 4 + 2 * 6 * 2))
    assert params["attn"]["q"]["kernel"].shape == (2, 32, 2 * 4 * 8)


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    assert_logits(folder, torch_logits(m))


def _flat_split(cfg, qkvz, ba):
    """The projections read as [q all heads | k | v | z] (not grouped per key head)."""
    b, s, _ = qkvz.shape
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    q, k, v, z = jnp.split(qkvz, np.cumsum([nk * dk, nk * dk, nv * dv]), axis=-1)
    bb, a = jnp.split(ba, 2, axis=-1)
    return (
        q.reshape(b, s, nk, dk),
        k.reshape(b, s, nk, dk),
        v.reshape(b, s, nv, dv),
        z.reshape(b, s, nv, dv),
        bb,
        a,
    )


def _plain_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w).astype(
        x.dtype
    )


_GATED_NORM = delta.gated_rms_norm
DROPS = {
    "attention output gate": (module, "output_gate", lambda attn, gate: attn),
    "zero-centred (1+w) norms": (module, "zero_centred_norm", _plain_norm),
    "causal conv": (delta, "causal_conv", lambda x, w: jax.nn.silu(x)),
    "per-key-head grouping": (delta, "split_heads", _flat_split),
    "decay": (delta, "log_decay", lambda a, a_log, dt_bias: jnp.zeros(a.shape, jnp.float32)),
    "gated norm's silu(z)": (
        delta,
        "gated_rms_norm",
        lambda o, z, w, eps: _GATED_NORM(o, 0 * z + 30, w, eps),
    ),
    "shared expert gate": (
        module,
        "shared_gate",
        lambda h, p, dt: jnp.ones((*h.shape[:-1], 1), dt),
    ),
    "partial rotary": (Qwen3NextConfig, "rotary_dim", property(lambda self: self.head_dim)),
}


@pytest.fixture(scope="module")
def hybrid(hf_dirs):
    """(config, params, transformers' logits) of the hybrid model, our (eager) forward checked
    equal once; the drops below run eagerly too (op by op: no whole-model compile per drop)."""
    folder, m = hf_dirs["hybrid"]
    cfg, params = read_params(folder)
    want = torch_logits(m)
    np.testing.assert_allclose(models.forward(cfg, params, TOKENS), want, atol=1e-4, rtol=0)
    return cfg, params, want


@pytest.mark.parametrize("part", DROPS)
def test_each_part_matters(hybrid, monkeypatch, part):
    cfg, params, want = hybrid
    owner, attr, replacement = DROPS[part]
    monkeypatch.setattr(owner, attr, replacement)
    assert_far(np.asarray(models.forward(cfg, params, TOKENS)), want)


def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path):
    folder, m = hf_dirs["hybrid"]
    out = roundtrip_bitwise(folder, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="eager").eval()  # fmt: skip
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert back.config.layer_types == m.config.layer_types
    assert back.config.rope_parameters["partial_rotary_factor"] == 0.5
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_sharding_axes(hf_dirs):
    cfg, _ = read_params(hf_dirs["hybrid"][0])
    axes, groups = models.param_axes_tree(cfg), models.param_groups_tree(cfg)
    assert axes["moe"]["experts"]["gate"]["kernel"] == ("layers", "experts", "embed", "mlp")
    assert axes["attn"]["q"]["kernel"] == ("layers", "embed", "heads") and groups["attn"]["q"][
        "kernel"
    ][2] == ("heads", 4)
    assert groups["linear"]["qkvz"]["kernel"][2] == ("heads", 2) and groups["linear"]["out"][
        "kernel"
    ][1] == ("heads", 4)
    assert axes["linear"]["conv"]["weight"] == ("layers", None, None, None)


def test_config_read_and_written(hf_dirs):
    folder, m = hf_dirs["dense_layer_tied"]
    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    cfg = models.config_from_hf(d)
    assert (cfg.moe_layers, cfg.dense_layers, cfg.tie_word_embeddings, cfg.norm_topk_prob) == (
        (0,),
        (1,),
        True,
        True,
    )
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
    no_types = {k: v for k, v in d.items() if k != "layer_types"} | {
        "num_hidden_layers": 8,
        "mlp_only_layers": [],
    }
    assert (
        list(models.config_from_hf(no_types).layer_types)
        == transformers.Qwen3NextConfig(**no_types).layer_types
    )
    with pytest.raises(
        ConfigError,
        match="c.json: .*linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2",
    ):
        models.config_from_hf(
            {**d, "linear_num_key_heads": 2, "linear_num_value_heads": 3}, source="c.json"
        )
    with pytest.raises(
        ConfigError, match="c.json: attention_bias=true is not supported for Qwen3NextForCausalLM"
    ):
        models.config_from_hf({**d, "attention_bias": True}, source="c.json")
    with pytest.raises(ConfigError, match="layer_types: expected 2 of"):
        models.config_from_hf(
            {**d, "layer_types": ["full_attention", "sliding_attention"]}, source="c.json"
        )


def test_the_fused_expert_layout_reads_as_the_per_expert_one(hf_dirs, tmp_path):
    """transformers 5.24's `save_original_format=False` keeps the experts fused
    (`mlp.experts.gate_up_proj` [X, 2I, E], `down_proj` [X, E, I]): read into the same params."""
    folder, m = hf_dirs["hybrid"]
    m.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in open_source(str(tmp_path)).tensors
    fused, per_expert = read_params(str(tmp_path))[1], read_params(folder)[1]
    jax.tree.map(np.testing.assert_array_equal, fused, per_expert)
