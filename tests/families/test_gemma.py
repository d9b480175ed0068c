"""Gemma 2 and Gemma 3 text against transformers' own models, saved by transformers in this session.

Each family: logits (fp32) equal transformers' eager forward within ATOL on three meshes (pp=2
and tp=4 among them), on a sequence longer than the sliding window and with both layer kinds
present; each Gemma-specific part, dropped, moves the logits by more than 100 * ATOL (so the
parity cannot hold by accident); import -> Orbax -> restore on another mesh -> export is bitwise
and the export loads in transformers with the same config and the same logits.

Tolerances: fp32 logits ATOL 1e-4 (observed ~4e-6 on logits of max ~3). bf16 compute: as far
from the fp32 reference as transformers' own bf16 forward is, within a factor BF16_FACTOR
(observed: both 3-6% of the largest |logit| with these random weights, ratio 0.9-1.2).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from e2e import roundtrip
from meshes import cases, fit

from hybridckpt import jobs, models
from hybridckpt.formats.registry import open_source
from hybridckpt.models.common import zeros
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.gemma2 import module as gemma2_module
from hybridckpt.models.gemma2.config import FULL, SLIDING, Gemma2Config
from hybridckpt.models.gemma3.config import Gemma3Config
from hybridckpt.models.rope import rope_type

ATOL = 1e-4
MOVED = 100 * ATOL  # a dropped part must move some logit by more (observed 0.4 to 6)
BF16_FACTOR = 2.0
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 12), dtype=np.int32)  # seq 12 > window 4
MESHES = cases(["dp=1", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"])

SIZES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # explicit, not hidden / heads
    sliding_window=4,
    query_pre_attn_scalar=24,  # not head_dim
    attn_implementation="eager",
)


def _gemma2(tied: bool = True):
    cfg = transformers.Gemma2Config(
        **SIZES,
        num_hidden_layers=4,  # local, global, local, global
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=tied,
        rope_theta=100.0,
    )
    return transformers.Gemma2ForCausalLM(cfg)


def _gemma3():
    cfg = transformers.Gemma3TextConfig(
        **SIZES,
        num_hidden_layers=6,  # 5 local, then 1 global (sliding_window_pattern 6)
        final_logit_softcapping=3.0,
        attn_logit_softcapping=1.0,  # transformers never applies it in Gemma 3; nor do we
        rope_theta=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},  # global layers only
        rope_local_base_freq=10.0,
    )
    return transformers.Gemma3ForCausalLM(cfg)


def _randomized(model, seed: int):
    """Every param normal(0, 0.3): norm weights far from 0, so (1 + w) vs w matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (folder, torch model, reference logits) of transformers-written checkpoints."""
    out = {}
    for seed, (name, make) in enumerate(
        [("gemma2", _gemma2), ("gemma2_untied", lambda: _gemma2(tied=False)), ("gemma3", _gemma3)]
    ):
        model = _randomized(make(), seed)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        out[name] = (str(folder), model, _torch_logits(model))
    return out


def test_checkpoints_hold_both_layer_kinds(hf):
    for name, want in [("gemma2", [SLIDING, FULL] * 2), ("gemma3", [SLIDING] * 5 + [FULL])]:
        cfg = jobs.open_checkpoint(hf[name][0]).config
        assert list(cfg.layer_types) == want == hf[name][1].config.layer_types
        assert type(cfg) is {"gemma2": Gemma2Config, "gemma3": Gemma3Config}[name]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_logits_equal_transformers(hf, name, mesh):
    folder, _, want = hf[name]
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), want, atol=ATOL, rtol=0)


def test_untied_and_bf16_logits(hf):
    folder, _, want = hf["gemma2_untied"]
    assert "lm_head.weight" in open_source(folder).tensors
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=fit("tp=4")), want, atol=ATOL, rtol=0)
    for name in ("gemma2", "gemma3"):
        folder, model, want = hf[name]
        got = jobs.logits(folder, TOKENS, compute_dtype="bfloat16")
        theirs = _torch_logits(copy.deepcopy(model).to(torch.bfloat16))
        ours_err, their_err = np.abs(got - want).max(), np.abs(theirs - want).max()
        assert ours_err <= BF16_FACTOR * their_err, (name, ours_err, their_err)


# -------------------------------------------------------------- each Gemma part matters


class _NormScaledByW(nn.Module):
    """Llama's RMSNorm on Gemma's zero-centred weights: scales by w, not 1 + w."""

    eps: float

    @nn.compact
    def __call__(self, x):
        w = self.param("scale", zeros((None,)), (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * w).astype(x.dtype)


PARTS = {
    # part: (families, how to drop it: a config change or a monkeypatch)
    "(1+w) norm": (("gemma2", "gemma3"), "norm"),
    "embedding scale": (("gemma2", "gemma3"), "embed"),
    "attention soft-cap": (("gemma2",), lambda c: {"attn_logit_softcapping": None}),
    "final soft-cap": (("gemma2", "gemma3"), lambda c: {"final_logit_softcapping": None}),
    "sliding window": (("gemma2", "gemma3"), lambda c: {"layer_types": (FULL,) * c.num_layers}),
    "query_pre_attn_scalar": (("gemma2",), lambda c: {"query_pre_attn_scalar": 16}),
    "q/k norms": (("gemma3",), "qk_norm"),
    "local RoPE base": (("gemma3",), lambda c: {"rope_local_base_freq": c.rope_theta}),
    "global RoPE scaling": (("gemma3",), lambda c: {"rope_scaling": None}),
}


@pytest.mark.parametrize("name, part", [(n, p) for p, (fams, _) in PARTS.items() for n in fams])
def test_each_gemma_part_matters(hf, monkeypatch, name, part):
    folder, _, want = hf[name]
    cfg = jobs.open_checkpoint(folder).config
    drop = PARTS[part][1]
    if drop == "norm":
        monkeypatch.setattr(gemma2_module, "GemmaRMSNorm", _NormScaledByW)
    elif drop == "embed":
        monkeypatch.setattr(gemma2_module.Gemma2, "embedding_scale", lambda self: 1.0)
    elif drop == "qk_norm":
        monkeypatch.setattr(models.family_of(cfg).flax_module(), "qk_norm", False)
    else:
        cfg = dataclasses.replace(cfg, **drop(cfg))
    got = jobs.logits(folder, TOKENS, config=cfg)
    assert np.abs(got - want).max() > MOVED, part


def test_gemma3_ignores_the_attention_soft_cap_as_transformers_does(hf, monkeypatch):
    """The gemma3 checkpoint says attn_logit_softcapping 1.0; applying it would move the logits."""
    folder, _, want = hf["gemma3"]
    cfg = jobs.open_checkpoint(folder).config
    assert cfg.attn_logit_softcapping == 1.0
    monkeypatch.setattr(models.family_of(cfg).flax_module(), "attention_softcap", lambda self: 1.0)
    assert np.abs(jobs.logits(folder, TOKENS) - want).max() > MOVED


# -------------------------------------------------------------------- round trip


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf, tmp_path, name):
    folder, model, want = hf[name]
    params, *_ = roundtrip(
        folder, tmp_path, mesh_a="fsdp=2,tp=2,pp=2", mesh_b="tp=4,pp=2", optimizer=False
    )
    source = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    assert sorted(params) == sorted(source)
    for k, v in source.items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)
    out = os.path.join(tmp_path, "exported")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(back) is type(model)
    mine, theirs = back.config.to_dict(), model.config.to_dict()
    ignore = {"transformers_version", "_name_or_path"}
    assert {k: mine.get(k) for k in theirs if k not in ignore} == {
        k: v for k, v in theirs.items() if k not in ignore
    }
    np.testing.assert_array_equal(_torch_logits(back.eval()), want)
    # and with default flags onto one device
    jobs.import_checkpoint(folder, str(tmp_path / "dp1"), mesh="dp=1")


# ------------------------------------------------------------------------ configs


def _transformers_config(d: dict):
    return transformers.AutoConfig.for_model(**d)


@pytest.mark.parametrize(
    "d",
    [
        # transformers 4 style: no layer_types, rope_theta + rope_scaling, pattern
        dict(model_type="gemma2", num_hidden_layers=5, rope_theta=500.0),
        dict(
            model_type="gemma3_text",
            num_hidden_layers=8,
            sliding_window_pattern=4,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
        dict(model_type="gemma3_text", num_hidden_layers=7),
        # google/gemma-2-2b and google/gemma-3-1b-pt config.json (transformers 4.42 / 4.50)
        dict(
            model_type="gemma2",
            architectures=["Gemma2ForCausalLM"],
            attention_bias=False,
            attn_logit_softcapping=50.0,
            cache_implementation="hybrid",
            final_logit_softcapping=30.0,
            head_dim=256,
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            hidden_size=2304,
            intermediate_size=9216,
            max_position_embeddings=8192,
            num_attention_heads=8,
            num_hidden_layers=26,
            num_key_value_heads=4,
            query_pre_attn_scalar=256,
            rms_norm_eps=1e-06,
            rope_theta=10000.0,
            sliding_window=4096,
            vocab_size=256000,
        ),
        dict(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            attention_bias=False,
            attn_logit_softcapping=None,
            cache_implementation="hybrid",
            final_logit_softcapping=None,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            hidden_size=1152,
            intermediate_size=6912,
            max_position_embeddings=32768,
            num_attention_heads=4,
            num_hidden_layers=26,
            num_key_value_heads=1,
            query_pre_attn_scalar=256,
            rms_norm_eps=1e-06,
            rope_local_base_freq=10000,
            rope_scaling=None,
            rope_theta=1000000,
            sliding_window=512,
            sliding_window_pattern=6,
            vocab_size=262144,
        ),
        # transformers 5 style: layer_types and rope_parameters
        dict(
            model_type="gemma3_text",
            num_hidden_layers=3,
            layer_types=[FULL, SLIDING, FULL],
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                SLIDING: {"rope_type": "default", "rope_theta": 2e4},
            },
        ),
    ],
)
def test_config_reads_as_transformers_does(d):
    sizes = {k: v for k, v in SIZES.items() if k != "attn_implementation"}
    d = {**sizes, **d}
    ours = models.config_from_hf(d, source="x/config.json")
    theirs = _transformers_config(d)
    assert list(ours.layer_types) == theirs.layer_types
    if isinstance(ours, Gemma3Config):
        full, local = theirs.rope_parameters[FULL], theirs.rope_parameters[SLIDING]
        assert ours.rope_theta == full["rope_theta"]
        assert ours.rope_local_base_freq == local["rope_theta"]
        assert dict(ours.rope_scaling or {}).get("factor") == full.get("factor")
        assert rope_type(ours.rope_scaling) == full["rope_type"]
        assert rope_type(ours.rope_local_scaling) == local["rope_type"]
    else:
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
        assert rope_type(ours.rope_scaling) == theirs.rope_parameters["rope_type"]
    for field in ("sliding_window", "query_pre_attn_scalar", "final_logit_softcapping"):
        assert getattr(ours, field) == getattr(theirs, field)
    # what we write, transformers reads as the same model, and so do we
    written = models.config_to_hf(ours)
    again = _transformers_config(json.loads(json.dumps(written)))
    assert again.layer_types == theirs.layer_types
    assert again.rope_parameters == theirs.rope_parameters
    assert models.config_from_hf(written) == ours
    for key in ("rope_scaling", "rope_parameters"):  # RoPE keys come back as written
        if d.get(key) is not None:
            assert written[key] == d[key], key
    assert models.config_from_dict(json.loads(json.dumps(models.config_to_dict(ours)))) == ours


@pytest.mark.parametrize(
    "change, words",
    [
        ({"hidden_activation": "gelu"}, ["hidden_activation", "'gelu'"]),
        ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
        ({"attention_bias": True}, ["attention_bias"]),
        ({"layer_types": [SLIDING]}, ["layer_types", "expected 5 entries"]),
        ({"layer_types": ["chunked_attention"] * 5}, ["chunked_attention"]),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
            ["'longrope'", "not implemented"],
        ),
        ({"num_key_value_heads": 3}, ["num_kv_heads 3"]),
    ],
)
def test_config_from_hf_rejects(change, words):
    sizes = {k: v for k, v in SIZES.items() if k != "attn_implementation"}
    cfg = models.config_from_hf({**sizes, "model_type": "gemma2", "num_hidden_layers": 5})
    d = {**models.config_to_hf(cfg), **change}
    with pytest.raises(ConfigError) as e:
        models.config_from_hf(d, source="ckpt/config.json")
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_param_tree_shapes_and_axes(hf, name):
    cfg = jobs.open_checkpoint(hf[name][0]).config
    layers = models.param_shape_tree(cfg)["layers"]
    assert layers["mlp_out_norm"]["scale"] == (cfg.num_layers, cfg.hidden_size)
    axes = models.logical_axes(cfg)["layers"]
    assert axes["q"]["kernel"] == ("layers", "embed", "heads")
    assert axes["k"]["kernel"] == ("layers", "embed", "kv_heads")
    assert axes["mlp_out_norm"]["scale"] == ("layers", None)
    if name == "gemma3":
        assert axes["q_norm"]["scale"] == axes["k_norm"]["scale"] == ("layers", None)
    assert set(models.rule_variables(cfg)) >= set(models.RULE_VARIABLES)
