"""models/llama4 and models/llama4_mm against transformers 5.24's own Llama4ForCausalLM and
Llama4ForConditionalGeneration.

Tiny models are built and saved by transformers' `save_pretrained` in this session, every
parameter random (`hf_parity.build`):
- "llama4": MoE layers 1 and 3 between dense layers 0 and 2 (`interleave_moe_layer_step` 2),
  NoPE layers 1 and 3 (`no_rope_layer_interval` 2) with temperature tuning (floor_scale 3, so the
  scale changes inside the sequence), chunked attention of 5 on the RoPE layers (the 12-token
  sequence crosses two chunk boundaries), the L2 q/k norm, llama3 RoPE scaling;
- "llama4_scout_rope": every layer MoE, top-2, Scout's llama3 scaling (low_freq_factor ==
  high_freq_factor), no q/k norm (Maverick's), tied;
- "llama4_mm": the wrapper (text as "llama4" with Scout's RoPE, a tiny vision tower). Its
  `forward` raises in transformers 5.24 (shown); `.language_model` is the reference.
Logits: fp32 against transformers' fp32 forward, atol 1e-4, on meshes with tp and pp (and one
with dp, over which the experts split), fitted to the devices present. Each Llama 4 fact turned
off in our config or module moves the logits far from transformers'. Import -> restore ->
export is bitwise and transformers loads the export back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_parity import (
    assert_far,
    build,
    load_fp32,
    other_mesh,
    pp_tp_mesh,
    read_params,
    roundtrip_bitwise,
)
from meshes import abstract_mesh, fit, spec

from hybridckpt import jobs, models, plan
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama4 import module as llama4_module
from hybridckpt.models.llama4.config import Llama4Config
from hybridckpt.models.llama4_mm.config import Llama4MMConfig

TOKENS = np.random.default_rng(2).integers(0, 90, (2, 12), dtype=np.int32)
ATOL = 1e-4
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
SCOUT_ROPE = {**LLAMA3, "factor": 16.0, "high_freq_factor": 1.0}
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=5, no_rope_layer_interval=2, floor_scale=3,
            attn_scale=0.5, max_position_embeddings=64, rope_parameters=LLAMA3)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8,
              patch_size=4, vision_output_dim=24, projector_input_dim=24, projector_output_dim=24)  # fmt: skip
# name -> (model class, config class, config kwargs)
MODELS = {
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", TEXT),
    "llama4_scout_rope": ("Llama4ForCausalLM", "Llama4TextConfig",
                          dict(TEXT, interleave_moe_layer_step=1, num_experts_per_tok=2, no_rope_layer_interval=4,
                               use_qk_norm=False, tie_word_embeddings=True, rope_parameters=SCOUT_ROPE)),
    "llama4_mm": ("Llama4ForConditionalGeneration", "Llama4Config",
                  dict(text_config=dict(TEXT, rope_parameters=SCOUT_ROPE), vision_config=VISION,
                       image_token_index=95, boi_token_index=93, eoi_token_index=94)),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, (model_cls, config_cls, kwargs)) in enumerate(MODELS.items()):
        m = build(model_cls, config_cls, kwargs, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


def _text_model(m: torch.nn.Module) -> torch.nn.Module:
    return m.language_model if isinstance(m, transformers.Llama4ForConditionalGeneration) else m


def _logits(m: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return _text_model(m).float()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


# --------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("name, mesh", [("llama4", pp_tp_mesh()), ("llama4_scout_rope", other_mesh()),
                                        ("llama4_mm", fit("dp=2,tp=2,pp=2", keep="dp"))])  # fmt: skip
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), _logits(m), atol=ATOL, rtol=0)


def test_the_router_picks_different_experts_across_tokens(hf_dirs):
    """The fixtures exercise the routing: transformers' own top-1 choice differs across tokens."""
    _, m = hf_dirs["llama4"]
    with torch.no_grad():
        out = m(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True)
    assert len(out.router_logits) == 2  # MoE layers 1 and 3
    for layer in out.router_logits:
        assert len(set(layer.argmax(-1).tolist())) >= 3


def test_the_wrappers_forward_raises_in_transformers(hf_dirs):
    """Why `.language_model` is the reference: transformers 5.24's wrapper forward fails on a text
    prompt (its output class reads an `image_outputs` its text model does not give)."""
    _, m = hf_dirs["llama4_mm"]
    with torch.no_grad(), pytest.raises(AttributeError, match="image_outputs"):
        m(torch.tensor(TOKENS, dtype=torch.long))


def _half_split_rope(x, cos, sin):
    """Llama's rotate_half RoPE on the same angles (pairs (i, i + hd/2), not (2i, 2i+1))."""
    half = x.shape[-1] // 2
    c, s = cos[None, :, None, :].astype(x.dtype), sin[None, :, None, :].astype(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _output_weighted_moe(cfg, dt, h, p):
    """The experts fed h and their outputs weighted by the sigmoid score (Mixtral's way)."""
    t = h.reshape(-1, h.shape[-1])
    logits = t @ p["router"]["kernel"]
    vals, idx = jax.lax.top_k(logits, cfg.num_experts_per_tok)
    w = jnp.sum(jax.nn.one_hot(idx, logits.shape[-1]) * jax.nn.sigmoid(vals)[..., None], axis=-2)
    gate_up = p["experts"]["gate_up"]["kernel"]
    g = jnp.einsum("te,xem->xtm", t, gate_up[:, :, 0])
    u = jnp.einsum("te,xem->xtm", t, gate_up[:, :, 1])
    y = jnp.einsum("xtm,xme->xte", u * jax.nn.silu(g), p["experts"]["down"]["kernel"])
    return (llama4_module.moe.swiglu(t, p["shared"], dt) + jnp.einsum("xte,tx->te", y, w)).reshape(h.shape)


CONFIG_FACTS = {  # our config with the fact turned off
    "chunked_attention": lambda c: dataclasses.replace(c, layer_types=("full_attention",) * c.num_layers),
    "nope_layers": lambda c: dataclasses.replace(c, no_rope_layers=(1,) * c.num_layers),
    "temperature_tuning": lambda c: dataclasses.replace(c, attn_temperature_tuning=False),
    "qk_norm": lambda c: dataclasses.replace(c, use_qk_norm=False),
    "llama3_scaling": lambda c: dataclasses.replace(c, rope_scaling=None),
}
MODULE_FACTS = {  # a function of our module replaced
    "interleaved_pair_rope": ("apply_pair_rope", _half_split_rope),
    "router_scales_the_input": ("moe_mlp", _output_weighted_moe),
}


@pytest.fixture(scope="module")
def llama4_params(hf_dirs):
    """(config, params as read, transformers' logits) of "llama4"."""
    folder, m = hf_dirs["llama4"]
    return (*read_params(folder), _logits(m))


def _quick_forward(cfg, params) -> np.ndarray:
    """Our logits on one device, compiled at XLA's lowest optimisation level (half the compile
    time; the values checked are far apart, so no tolerance hangs on it)."""
    lowered = jax.jit(lambda p: models.forward(cfg, p, TOKENS)).lower(params)
    return np.asarray(lowered.compile(compiler_options={"xla_backend_optimization_level": 0})(params))


@pytest.mark.parametrize("fact", [*CONFIG_FACTS, *MODULE_FACTS, "shared_expert"])
def test_each_llama4_fact_matters(llama4_params, monkeypatch, fact):
    """Same params, one fact dropped: the logits leave transformers' far behind (with it, they
    equal transformers': `test_logits_equal_transformers`)."""
    cfg, params, want = llama4_params
    if fact in CONFIG_FACTS:
        cfg = CONFIG_FACTS[fact](cfg)
    elif fact in MODULE_FACTS:
        monkeypatch.setattr(llama4_module, *MODULE_FACTS[fact])
    else:
        shared = {k: {"kernel": np.zeros_like(v["kernel"])} for k, v in params["moe"]["shared"].items()}
        params = params | {"moe": params["moe"] | {"shared": shared}}
    assert_far(_quick_forward(cfg, params), want)


def test_moe_and_dense_layers_stack_apart_and_the_fused_experts_split_gate_up(hf_dirs):
    folder, m = hf_dirs["llama4"]
    cfg, params = read_params(folder)
    assert (cfg.moe_layers, cfg.dense_layers, cfg.rope_layers) == ((1, 3), (0, 2), (True, False) * 2)
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    ff = "model.layers.{}.feed_forward."
    gate_up, down = params["moe"]["experts"]["gate_up"]["kernel"], params["moe"]["experts"]["down"]["kernel"]
    assert gate_up.shape == (2, 4, 32, 2, 24) and down.shape == (2, 4, 24, 32)
    fused = sd[ff.format(3) + "experts.gate_up_proj"]  # MoE layer 3 is position 1 of the group
    np.testing.assert_array_equal(gate_up[1, :, :, 0], fused[..., :24])
    np.testing.assert_array_equal(gate_up[1, :, :, 1], fused[..., 24:])
    np.testing.assert_array_equal(down[1], sd[ff.format(3) + "experts.down_proj"])
    np.testing.assert_array_equal(params["moe"]["router"]["kernel"][0], sd[ff.format(1) + "router.weight"].T)
    np.testing.assert_array_equal(params["mlp"]["down"]["kernel"][1], sd[ff.format(2) + "down_proj.weight"].T)


def test_experts_split_over_dp_and_heads_over_tp():
    cfg = models.config_from_hf(transformers.Llama4TextConfig(**TEXT).to_dict())
    p = plan.for_model(cfg, abstract_mesh("dp=2,fsdp=2,tp=2"), axis_rules="")
    s = p.param_shardings
    assert s["moe"]["experts"]["gate_up"]["kernel"].spec == spec("dp=2,fsdp=2,tp=2", None, "dp", "fsdp", None, "tp")
    assert s["moe"]["experts"]["down"]["kernel"].spec == spec("dp=2,fsdp=2,tp=2", None, "dp", "tp", "fsdp")
    assert s["layers"]["q"]["kernel"].spec == spec("dp=2,fsdp=2,tp=2", None, "fsdp", "tp")
    assert models.param_groups_tree(cfg)["layers"]["k"]["kernel"][2] == ("kv_heads", 2)


# ------------------------------------------------------------------- import, export, reload


@pytest.mark.parametrize("name", ["llama4_scout_rope", "llama4_mm"])
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    if name == "llama4_mm":
        back = transformers.Llama4ForConditionalGeneration.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
        vision = [{k: v for k, v in c.vision_config.to_dict().items() if k != "dtype"} for c in (back.config, m.config)]
        assert vision[0] == vision[1]
        assert back.config.image_token_index == m.config.image_token_index
    else:
        back = load_fp32(out)
    assert type(back) is type(m)
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    text = _text_model(back).config
    for key in ("moe_layers", "no_rope_layers", "layer_types", "attention_chunk_size", "use_qk_norm", "floor_scale",
                "attn_scale", "rope_parameters", "tie_word_embeddings", "num_experts_per_tok"):  # fmt: skip
        assert getattr(text, key) == getattr(_text_model(m).config, key), key
    np.testing.assert_array_equal(_logits(back), _logits(m))


# ------------------------------------------------------------------------------ configs


def test_configs_read_and_written(hf_dirs):
    for name in MODELS:
        cfg = jobs.open_checkpoint(hf_dirs[name][0]).config
        assert type(cfg) is (Llama4MMConfig if name == "llama4_mm" else Llama4Config)
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    mm = jobs.open_checkpoint(hf_dirs["llama4_mm"][0]).config
    assert (mm.vision_positions, mm.vision_num_layers, mm.projector_output_dim) == (5, 2, 24)


def test_absent_keys_take_transformers_defaults():
    """A sparse config.json: transformers' Llama4TextConfig fills head_dim 128 (not hidden/heads),
    8 kv heads... as we do; the layer pattern follows the step and the interval."""
    d = {"architectures": ["Llama4ForCausalLM"], "hidden_size": 256, "num_attention_heads": 16, "num_hidden_layers": 8,
         "interleave_moe_layer_step": 4, "vocab_size": 64}  # fmt: skip
    cfg = models.config_from_hf(d)
    theirs = transformers.Llama4TextConfig(**{k: v for k, v in d.items() if k != "architectures"})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps) == (
        theirs.head_dim, theirs.num_key_value_heads, 500000.0, theirs.rms_norm_eps)  # fmt: skip
    assert list(cfg.moe_layers) == theirs.moe_layers and list(cfg.no_rope_layers) == theirs.no_rope_layers
    assert list(cfg.layer_types) == theirs.layer_types and cfg.attention_chunk_size == 8192
    # Scout's and Maverick's config.json say `"attn_temperature_tuning": 4` (truthy, as transformers reads it)
    assert models.config_from_hf({**d, "attn_temperature_tuning": 4}).attn_temperature_tuning is True


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "c.json: attention_bias=true is not supported"),
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None}, "attention_chunk_size is null"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types: expected 4 of"),
    ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers: expected at least 4 entries of 0"),
    ({"moe_layers": [1, 9]}, "moe_layers: .* outside 0..3"),
    ({"interleave_moe_layer_step": 0}, "interleave_moe_layer_step: expected a positive int"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds num_experts 4"),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": 0.5}}, "high_freq_factor must be at least low_freq_factor"),
])  # fmt: skip
def test_bad_configs_are_one_config_error(change, message):
    d = {**transformers.Llama4TextConfig(**TEXT).to_dict(), "architectures": ["Llama4ForCausalLM"], **change}
    with pytest.raises(ConfigError, match=message):
        models.config_from_hf(d, source="c.json")
