"""models/: param trees, HF parity of logits (fp32, bf16), sharded forward and one adamw step.

Tolerances: fp32 logits vs transformers atol 1e-4 (observed ~4e-6 on logits of std ~1.2);
bf16 compute vs the fp32 reference within BF16_TOL of the largest |logit| (observed 1-2%, i.e.
a few bf16 ulps of 2^-8 after 2 layers); sharded vs unsharded logits atol 1e-5 (only the
reduction order differs across devices); adamw step rtol 1e-6 (see that test for its atol).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from jax.sharding import NamedSharding
from meshes import device_count, fit_mesh, spec

import hybridckpt.errors
from hybridckpt import models
from hybridckpt.mesh import batch_sharding, tree_shardings
from hybridckpt.models import GPT2Config, LlamaConfig
from hybridckpt.models.errors import ConfigError
from hybridckpt.plan import optax_state_shardings

BF16_TOL = 0.05  # max |bf16 - fp32| / max |fp32 logit|

LLAMA = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
LLAMA_TIED = dataclasses.replace(LLAMA, tie_word_embeddings=True)
GPT2 = GPT2Config(
    vocab_size=128, n_positions=8, n_embd=64, n_layer=2, n_head=4, layer_norm_epsilon=1e-5
)

jit_forward = jax.jit(models.forward, static_argnums=0, static_argnames="compute_dtype")
jit_loss = jax.jit(models.loss, static_argnums=0)


def _tokens(cfg, batch: int = 4, seq: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32)


def _random_params(cfg, seed: int = 0, std: float = 0.15) -> dict:
    """Params large enough that logits are O(1): normal(std), norm scales 1 + normal(0.2)."""
    rng = np.random.default_rng(seed)
    shapes = models.param_shapes(cfg)

    def leaf(path, s):
        x = rng.normal(0, std if path[-1].key != "scale" else 0.2, s.shape).astype(np.float32)
        return jnp.asarray(x + (path[-1].key == "scale"))

    return jax.tree_util.tree_map_with_path(leaf, shapes)


# ------------------------------------------------------------------------------ param trees

EXPECTED_AXES = {
    "llama": {
        "embed": {"embedding": ("vocab", "embed")},
        "layers": {
            "attn_norm": {"scale": ("layers", None)},
            "q": {"kernel": ("layers", "embed", "heads")},
            "k": {"kernel": ("layers", "embed", "kv_heads")},
            "v": {"kernel": ("layers", "embed", "kv_heads")},
            "o": {"kernel": ("layers", "heads", "embed")},
            "mlp_norm": {"scale": ("layers", None)},
            "gate": {"kernel": ("layers", "embed", "mlp")},
            "up": {"kernel": ("layers", "embed", "mlp")},
            "down": {"kernel": ("layers", "mlp", "embed")},
        },
        "final_norm": {"scale": (None,)},
        "lm_head": {"kernel": ("embed", "vocab")},
    },
    "gpt2": {
        "wte": {"embedding": ("vocab", "embed")},
        "wpe": {"embedding": (None, "embed")},
        "layers": {
            "ln_1": {"scale": ("layers", None), "bias": ("layers", None)},
            "qkv": {
                "kernel": ("layers", "embed", None, "heads"),
                "bias": ("layers", None, "heads"),
            },
            "attn_out": {"kernel": ("layers", "heads", "embed"), "bias": ("layers", None)},
            "ln_2": {"scale": ("layers", None), "bias": ("layers", None)},
            "fc": {"kernel": ("layers", "embed", "mlp"), "bias": ("layers", "mlp")},
            "proj": {"kernel": ("layers", "mlp", "embed"), "bias": ("layers", None)},
        },
        "ln_f": {"scale": (None,), "bias": (None,)},
    },
}


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


@pytest.mark.parametrize("cfg", [LLAMA, LLAMA_TIED, GPT2], ids=["llama", "llama_tied", "gpt2"])
def test_param_tree_and_logical_axes(cfg):
    expected = dict(EXPECTED_AXES[cfg.family])
    if getattr(cfg, "tie_word_embeddings", False):
        del expected["lm_head"]
    axes = models.logical_axes(cfg)
    assert axes == expected
    shapes = models.param_shapes(cfg)
    assert jax.tree.structure(shapes) == jax.tree.structure(expected, is_leaf=_is_axes)
    for s, a in zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=_is_axes), strict=True):
        assert isinstance(s, jax.ShapeDtypeStruct) and s.dtype == jnp.float32
        assert len(a) == len(s.shape)
    layers = shapes["layers"]
    if cfg.family == "llama":
        L, E, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
        assert layers["q"]["kernel"].shape == (L, E, cfg.num_heads * hd)
        assert layers["k"]["kernel"].shape == (L, E, cfg.num_kv_heads * hd)
        assert layers["down"]["kernel"].shape == (L, cfg.intermediate_size, E)
    else:
        assert layers["qkv"]["kernel"].shape == (cfg.n_layer, cfg.n_embd, 3, cfg.n_embd)
        assert layers["qkv"]["bias"].shape == (cfg.n_layer, 3, cfg.n_embd)
        assert layers["fc"]["kernel"].shape == (cfg.n_layer, cfg.n_embd, cfg.n_inner)


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_init_params(cfg):
    params = models.init_params(cfg, jax.random.key(1))
    assert type(params) is dict and type(params["layers"]) is dict
    assert jax.tree.structure(params) == jax.tree.structure(models.param_shapes(cfg))
    for p, s in zip(
        jax.tree.leaves(params), jax.tree.leaves(models.param_shapes(cfg)), strict=True
    ):
        assert isinstance(p, jax.Array) and p.dtype == s.dtype and p.shape == s.shape
    layers = params["layers"]
    kernel = layers["q" if cfg.family == "llama" else "fc"]["kernel"]
    norm = layers["attn_norm" if cfg.family == "llama" else "ln_1"]
    np.testing.assert_array_equal(norm["scale"], np.ones(norm["scale"].shape, np.float32))
    # layers are initialised independently, with a small normal
    assert not np.array_equal(kernel[0], kernel[1])
    assert 0.015 < float(jnp.std(kernel)) < 0.025
    again = models.init_params(cfg, jax.random.key(1))
    np.testing.assert_array_equal(
        again["layers"]["up" if cfg.family == "llama" else "proj"]["kernel"],
        layers["up" if cfg.family == "llama" else "proj"]["kernel"],
    )


# ------------------------------------------------------------------------- HF parity helpers


def _randomize_torch(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.15)
            elif name.endswith("weight"):  # norm scales
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # biases
                p.normal_(0.0, 0.1)


def _hf_llama(cfg: LlamaConfig, seed: int = 0):
    hf_cfg = transformers.LlamaConfig(**models.config_to_hf(cfg), attn_implementation="eager")
    model = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    _randomize_torch(model, seed)
    return model


def _hf_gpt2(cfg: GPT2Config, seed: int = 0):
    hf_cfg = transformers.GPT2Config(
        **models.config_to_hf(cfg),
        attn_implementation="eager",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(hf_cfg).float().eval()
    _randomize_torch(model, seed)
    return model


def _sd(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _llama_params_from_hf(cfg: LlamaConfig, model) -> dict:
    sd = _sd(model)

    def stack(name, transpose=True):
        ws = [sd[f"model.layers.{i}.{name}.weight"] for i in range(cfg.num_layers)]
        return np.stack([w.T if transpose else w for w in ws])

    params = {
        "embed": {"embedding": sd["model.embed_tokens.weight"]},
        "layers": {
            "attn_norm": {"scale": stack("input_layernorm", transpose=False)},
            "q": {"kernel": stack("self_attn.q_proj")},
            "k": {"kernel": stack("self_attn.k_proj")},
            "v": {"kernel": stack("self_attn.v_proj")},
            "o": {"kernel": stack("self_attn.o_proj")},
            "mlp_norm": {"scale": stack("post_attention_layernorm", transpose=False)},
            "gate": {"kernel": stack("mlp.gate_proj")},
            "up": {"kernel": stack("mlp.up_proj")},
            "down": {"kernel": stack("mlp.down_proj")},
        },
        "final_norm": {"scale": sd["model.norm.weight"]},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": sd["lm_head.weight"].T}
    return params


def _gpt2_params_from_hf(cfg: GPT2Config, model) -> dict:
    sd = _sd(model)
    e = cfg.n_embd

    def stack(name, shape=None):
        ws = [sd[f"transformer.h.{i}.{name}"] for i in range(cfg.n_layer)]
        return np.stack([w.reshape(shape) if shape else w for w in ws])

    def ln(name):
        return {"scale": stack(f"{name}.weight"), "bias": stack(f"{name}.bias")}

    def conv(name, kshape=None, bshape=None):  # HF Conv1D weights are already [in, out]
        return {"kernel": stack(f"{name}.weight", kshape), "bias": stack(f"{name}.bias", bshape)}

    return {
        "wte": {"embedding": sd["transformer.wte.weight"]},
        "wpe": {"embedding": sd["transformer.wpe.weight"]},
        "layers": {
            "ln_1": ln("ln_1"),
            "qkv": conv("attn.c_attn", (e, 3, e), (3, e)),
            "attn_out": conv("attn.c_proj"),
            "ln_2": ln("ln_2"),
            "fc": conv("mlp.c_fc"),
            "proj": conv("mlp.c_proj"),
        },
        "ln_f": {"scale": sd["transformer.ln_f.weight"], "bias": sd["transformer.ln_f.bias"]},
    }


def _hf_logits_and_loss(model, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    with torch.no_grad():
        ids = torch.from_numpy(tokens.astype(np.int64))
        out = model(input_ids=ids, labels=ids)
    return out.logits.numpy(), float(out.loss)


def _check_parity(cfg, params, ref_logits, ref_loss, tokens, with_bf16=True):
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), models.param_shapes(cfg))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == shapes
    logits = np.asarray(jit_forward(cfg, params, tokens))
    assert logits.dtype == np.float32 and logits.shape == ref_logits.shape
    assert ref_logits.std() > 0.5  # O(1) logits, so atol 1e-4 is a real test
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4)
    if not with_bf16:
        return
    np.testing.assert_allclose(float(jit_loss(cfg, params, tokens)), ref_loss, rtol=1e-5)
    low = np.asarray(jit_forward(cfg, params, tokens, compute_dtype=jnp.bfloat16))
    assert low.dtype == np.float32
    err = np.abs(low - ref_logits).max() / np.abs(ref_logits).max()
    assert 1e-3 < err < BF16_TOL, err  # > 1e-3: the compute really ran in bf16


# ------------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("cfg", [LLAMA, LLAMA_TIED], ids=["untied", "tied"])
def test_llama_logits_match_transformers(cfg):
    model = _hf_llama(cfg, seed=1)
    tokens = _tokens(cfg)
    ref_logits, ref_loss = _hf_logits_and_loss(model, tokens)
    params = _llama_params_from_hf(cfg, model)
    _check_parity(cfg, params, ref_logits, ref_loss, tokens, with_bf16=not cfg.tie_word_embeddings)

    # the comparison sees the RoPE convention: Meta's interleaved q/k rows give other logits
    hd = cfg.head_dim
    perm = np.arange(hd).reshape(2, hd // 2).T.reshape(-1)  # half-split -> interleaved
    for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
        k = params["layers"][name]["kernel"]
        cols = (np.arange(heads)[:, None] * hd + perm[None]).reshape(-1)
        params["layers"][name]["kernel"] = k[..., cols]
    wrong = np.asarray(jit_forward(cfg, params, tokens))
    assert np.abs(wrong - ref_logits).max() > 1e-2


def test_gpt2_logits_match_transformers():
    model = _hf_gpt2(GPT2, seed=2)
    tokens = _tokens(GPT2)  # seq = n_positions: every position row is used
    ref_logits, ref_loss = _hf_logits_and_loss(model, tokens)
    params = _gpt2_params_from_hf(GPT2, model)
    _check_parity(GPT2, params, ref_logits, ref_loss, tokens)


def test_gpt2_rejects_sequences_longer_than_n_positions():
    params = _random_params(GPT2)
    with pytest.raises(ConfigError, match="n_positions 8"):
        models.forward(GPT2, params, _tokens(GPT2, seq=GPT2.n_positions + 1))


# ----------------------------------------------------------------------------- sharding


def _place(cfg, params, mesh):
    shardings = tree_shardings(models.param_shapes(cfg), models.logical_axes(cfg), mesh)
    return jax.device_put(params, shardings), shardings


@pytest.mark.parametrize(
    "cfg, mesh_shape",
    [
        (LLAMA, "fsdp=2,tp=2,pp=2"),
        (LLAMA, "dp=2,tp=4"),
        (GPT2, "fsdp=2,tp=2,pp=2"),
    ],
    ids=["llama-fsdp2-tp2-pp2", "llama-dp2-tp4", "gpt2-fsdp2-tp2-pp2"],
)
def test_sharded_forward_matches_unsharded(cfg, mesh_shape):
    params = _random_params(cfg, seed=3)
    tokens = _tokens(cfg, seed=4)
    ref = np.asarray(jit_forward(cfg, params, tokens))

    mesh = fit_mesh(mesh_shape)
    sharded, _ = _place(cfg, params, mesh)
    name = "q" if cfg.family == "llama" else "fc"
    kernel = sharded["layers"][name]["kernel"]
    assert kernel.sharding.spec == spec(mesh, "pp", "fsdp", "tp")
    if device_count() > 1:
        assert kernel.addressable_shards[0].data.shape != kernel.shape  # really split
    logits = jit_forward(cfg, sharded, jax.device_put(tokens, batch_sharding(mesh)))
    np.testing.assert_allclose(np.asarray(logits), ref, rtol=0, atol=1e-5)
    assert ref.std() > 0.5


def _adamw_step(cfg, opt, params, opt_state, tokens):
    value, grads = jax.value_and_grad(partial(models.loss, cfg))(params, tokens)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def test_adamw_step_on_pp_mesh_matches_unsharded():
    cfg = LLAMA
    # eps=0.1 keeps the update Lipschitz in the gradient (|d update / d g| <= lr / eps): gradients
    # from another reduction order differ by up to ~2e-6 of a leaf's largest entry (embedding rows
    # summed over tokens), and lr / eps = 1e-2 keeps that under rtol 1e-6 of the params (atol 1e-8
    # for params near 0). With eps=1e-8 the first step is ~lr * sign(g) and amplifies that noise.
    opt = optax.adamw(1e-3, eps=0.1, weight_decay=0.1)
    step = jax.jit(partial(_adamw_step, cfg, opt))
    params = _random_params(cfg, seed=5)
    tokens = _tokens(cfg, seed=6)
    ref_params, ref_state, ref_loss = step(params, opt.init(params), tokens)
    moved = np.abs(
        np.asarray(ref_params["layers"]["down"]["kernel"] - params["layers"]["down"]["kernel"])
    )
    assert moved.max() > 1e-4  # the step moves params ~1000x beyond the tolerances below

    mesh = fit_mesh("fsdp=2,tp=2,pp=2")
    sharded, shardings = _place(cfg, params, mesh)
    state_shapes = jax.eval_shape(opt.init, params)
    state_shardings = optax_state_shardings(state_shapes, shardings, mesh)
    state = jax.jit(opt.init, out_shardings=state_shardings)(sharded)
    new_params, new_state, new_loss = step(
        sharded, state, jax.device_put(tokens, batch_sharding(mesh))
    )
    gate = new_params["layers"]["gate"]["kernel"]  # on 1 device jit names its sharding P(): the same
    assert gate.sharding.is_equivalent_to(NamedSharding(mesh, spec(mesh, "pp", "fsdp", "tp")), gate.ndim)

    np.testing.assert_allclose(float(new_loss), float(ref_loss), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-8)
    # adam's mu / nu are the gradient (squared): agree to 1e-5 of each leaf's largest entry
    for got, want in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state), strict=True):
        scale = float(np.abs(np.asarray(want)).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)


# -------------------------------------------------------------------------------- configs


def test_hf_config_round_trip_through_transformers():
    for cfg, cls in (
        (LLAMA, transformers.LlamaConfig),
        (LLAMA_TIED, transformers.LlamaConfig),
        (GPT2, transformers.GPT2Config),
    ):
        d = models.config_to_hf(cfg)
        hf = cls.from_dict(d)
        assert models.config_from_hf(hf.to_dict()) == cfg
        assert models.config_from_hf(d) == cfg
    # transformers' own defaults and rope_theta spelling are read
    hf = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        rope_theta=500000.0,
    ).to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    cfg = models.config_from_hf(hf)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.num_layers) == (8, 3, 500000.0, 3)
    assert (
        models.config_from_hf(
            {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}
        ).n_inner
        == 128
    )


def test_hf_param_shapes_agree_with_ours():
    for cfg, model in (
        (LLAMA, _hf_llama(LLAMA)),
        (LLAMA_TIED, _hf_llama(LLAMA_TIED)),
        (GPT2, _hf_gpt2(GPT2)),
    ):
        ours = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(models.param_shapes(cfg)))
        theirs = sum(p.numel() for p in model.parameters())  # tied weights counted once
        assert ours == theirs


@pytest.mark.parametrize(
    "d, words",
    [
        (
            {"architectures": ["FalconForCausalLM"], "model_type": "falcon"},
            ["FalconForCausalLM", "LlamaForCausalLM", "GPT2LMHeadModel"],
        ),
        ({"model_type": "bert"}, ["'bert'", "gpt2"]),
        ({"model_type": "llama", "vocab_size": 8}, ["missing ['hidden_size', 'intermediate_size'"]),
        (
            {**models.config_to_hf(LLAMA), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            ["llama3"],
        ),
        (
            {
                **models.config_to_hf(LLAMA),
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0},
            },
            ["yarn"],
        ),
        ({**models.config_to_hf(LLAMA), "hidden_act": "gelu"}, ["hidden_act", "gelu"]),
        (
            {**models.config_to_hf(GPT2), "activation_function": "relu"},
            ["activation_function", "relu"],
        ),
        ({**models.config_to_hf(LLAMA), "num_key_value_heads": 3}, ["num_kv_heads 3"]),
    ],
)
def test_config_from_hf_rejects(d, words):
    with pytest.raises(ConfigError) as e:
        models.config_from_hf(d, source="ckpt/config.json")
    for w in words:
        assert w in str(e.value)
    if "missing" in words[0] or "Falcon" in words[0]:
        assert "ckpt/config.json" in str(e.value)


def test_config_from_meta_params():
    # MLP widths of the published HF conversions (meta-llama/Llama-2-7b-hf, -70b-hf,
    # Meta-Llama-3-8B): the rule meta-llama/llama:llama/model.py applies to params.json
    llama2_7b = {
        "dim": 4096,
        "multiple_of": 256,
        "n_heads": 32,
        "n_layers": 32,
        "norm_eps": 1e-05,
        "vocab_size": -1,
    }
    cfg = models.config_from_meta_params(llama2_7b, vocab_size=32000)
    assert cfg == LlamaConfig(32000, 4096, 11008, 32, 32, 32, 128, 1e-5, 10000.0, False, 2048)
    llama2_70b = {
        "dim": 8192,
        "multiple_of": 4096,
        "ffn_dim_multiplier": 1.3,
        "n_heads": 64,
        "n_kv_heads": 8,
        "n_layers": 80,
        "norm_eps": 1e-05,
        "vocab_size": -1,
    }
    assert models.config_from_meta_params(llama2_70b, 32000).intermediate_size == 28672
    llama3_8b = {
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "vocab_size": 128256,
        "multiple_of": 1024,
        "ffn_dim_multiplier": 1.3,
        "norm_eps": 1e-05,
        "rope_theta": 500000.0,
    }
    cfg = models.config_from_meta_params(llama3_8b)
    assert (cfg.intermediate_size, cfg.num_kv_heads, cfg.vocab_size, cfg.rope_theta) == (
        14336,
        8,
        128256,
        500000.0,
    )
    assert not cfg.tie_word_embeddings

    with pytest.raises(ConfigError, match="vocab_size"):
        models.config_from_meta_params(llama2_7b)
    with pytest.raises(ConfigError, match="128256.*disagrees.*32000"):
        models.config_from_meta_params(llama3_8b, 32000)
    # use_scaled_rope (Llama 3.1+): the llama3 rope type, tests/families/test_llama_rope.py
    scaled = models.config_from_meta_params({**llama3_8b, "use_scaled_rope": True})
    assert dict(scaled.rope_scaling)["rope_type"] == "llama3"
    with pytest.raises(ConfigError, match="params.json.*missing \\['n_layers'\\]"):
        models.config_from_meta_params({"dim": 64, "n_heads": 4, "vocab_size": 10})


def test_config_dict_round_trip_and_errors():
    for cfg in (LLAMA, LLAMA_TIED, GPT2):
        d = models.config_to_dict(cfg)
        assert d["family"] == cfg.family
        assert models.config_from_dict(d) == cfg
    assert GPT2.num_layers == GPT2.n_layer == 2
    assert LlamaConfig(10, 32, 8, 1, 4, 4).head_dim == 8
    with pytest.raises(ConfigError, match="'bert'"):
        models.config_from_dict({"family": "bert"})
    with pytest.raises(ConfigError, match="unknown keys \\['bogus'\\]"):
        models.config_from_dict({**models.config_to_dict(GPT2), "bogus": 1})
    with pytest.raises(ConfigError, match="n_embd 30 is not divisible by n_head 4"):
        GPT2Config(10, 8, 30, 1, 4)


# ------------------------------------------------------------------------------- registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (nothing imported yet) from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_registry_discovers_the_families():
    fams = models.families()
    assert set(fams) >= {"llama", "gpt2"}
    assert fams["llama"].config_cls is LlamaConfig and fams["gpt2"].config_cls is GPT2Config
    for cfg in (LLAMA, LLAMA_TIED, GPT2):
        fam = models.family_of(cfg)
        assert fam.name == cfg.family
        text, origin = models.hf_rules(cfg)
        assert origin == f"models/{fam.name}/params.py table" and "->" in text
        assert set(models.rule_variables(cfg)) >= set(models.RULE_VARIABLES)
    with pytest.raises(ConfigError, match="expected a model config.*found int"):
        models.family_of(3)


def test_rule_variables_of_both_families():
    assert models.rule_variables(LLAMA) == {
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "hidden_size": 64,
        "vocab_size": 128,
        "num_layers": 2,
        "intermediate_size": 128,
        "tied": False,
    }
    assert models.rule_variables(GPT2) == {
        "num_heads": 4,
        "num_kv_heads": 4,
        "head_dim": 16,
        "hidden_size": 64,
        "vocab_size": 128,
        "num_layers": 2,
        "intermediate_size": 256,
        "tied": True,
    }


def test_hf_name_fixes():
    assert models.hf_name_fixes(LLAMA, ["model.norm.weight"]) == ""
    assert models.hf_name_fixes(GPT2, ["transformer.wte.weight", "lm_head.weight"]) == ""
    # a bare GPT2Model's file: no `transformer.` prefix
    assert models.hf_name_fixes(GPT2, ["wte.weight", "h.0.ln_1.weight"]) == (
        "lm_head.weight -> lm_head.weight\n* -> transformer.*\n"
    )


def test_one_config_error_class():
    assert hybridckpt.errors.ConfigError is ConfigError
    assert hybridckpt.errors.HybridCkptError is models.errors.HybridCkptError
    assert issubclass(hybridckpt.errors.FormatError, models.errors.HybridCkptError)


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ConfigError) as e:
        models.config_from_hf({"architectures": ["BertForMaskedLM"]}, source="x/config.json")
    msg = str(e.value)
    assert msg.startswith("x/config.json: architectures ['BertForMaskedLM']")
    for fam in models.families().values():
        for word in (*fam.hf_architectures, *fam.hf_model_types):
            assert word in msg


def test_models_imports_nothing_from_hybridckpt_nor_jax():
    out = _python(
        """
        import sys
        from hybridckpt import models
        cfg = models.config_from_hf({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2})
        models.param_shape_tree(cfg), models.rule_variables(cfg), models.hf_rules(cfg)
        models.config_from_dict(models.config_to_dict(cfg))
        ours = ("hybridckpt", "hybridckpt.errors", "hybridckpt.models")
        bad = [m for m in sys.modules if m.split(".")[0] in ("jax", "flax")
               or (m.startswith("hybridckpt") and not m.startswith(ours[2]) and m not in ours)]
        assert not bad, bad
        print("ok")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
