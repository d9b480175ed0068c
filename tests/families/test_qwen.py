"""models/qwen2 and models/qwen3 against transformers' own Qwen2ForCausalLM / Qwen3ForCausalLM.

Tiny models are built and saved by transformers in this session (fp32 safetensors; one bf16),
every parameter drawn at random first (transformers initialises biases to 0 and norms to 1,
which would hide a dropped bias or norm). Tolerances: fp32 logits vs transformers atol 1e-4
(observed ~2e-6 on logits of max ~3); the exported folder, loaded back by transformers, gives
bit-identical logits.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from e2e import roundtrip
from meshes import cases, fit

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen2.config import Qwen2Config
from hybridckpt.models.qwen3.config import Qwen3Config

TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4], [0, 11, 42, 17, 6, 5, 90, 3]], dtype=np.int32)
ATOL = 1e-4
MESHES = ["dp=1", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"]  # every family on each; variants on one
SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0, max_position_embeddings=64,
)  # fmt: skip
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 5000.0,
}
LINEAR = {"rope_type": "linear", "factor": 3.0, "rope_theta": 5000.0}
# name -> (transformers model class, config class, config overrides, saved dtype)
MODELS = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}, torch.float32),
    "qwen2_tied": ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True}, torch.float32),
    # head_dim 12: heads * head_dim = 48 != hidden 32
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 12}, torch.float32),
    "qwen3_bias_tied": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {"head_dim": 12, "attention_bias": True, "tie_word_embeddings": True},
        torch.float32,
    ),  # fmt: skip
    "qwen3_bf16": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 12}, torch.bfloat16),
    # RoPE scaling as Qwen2.5's long-context configs (yarn) and a linear one
    "qwen2_yarn": ("Qwen2ForCausalLM", "Qwen2Config", {"rope_parameters": YARN}, torch.float32),
    "qwen3_linear": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {"head_dim": 12, "rope_parameters": LINEAR},
        torch.float32,
    ),  # fmt: skip
}


def _build(name: str, seed: int) -> torch.nn.Module:
    model_cls, config_cls, overrides, dtype = MODELS[name]
    cfg = getattr(transformers, config_cls)(**SIZES, **overrides, attn_implementation="eager")
    m = getattr(transformers, model_cls)(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            centre = 1.0 if pname.endswith("norm.weight") else 0.0
            p.normal_(centre, 0.15 if p.ndim > 1 else 0.3)
    return m.to(dtype)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers, its model)."""
    out = {}
    for seed, name in enumerate(MODELS):
        m = _build(name, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), _load_fp32(folder) if m.dtype != torch.float32 else m)
    return out


def _load_fp32(folder) -> torch.nn.Module:
    """transformers' own model of `folder` computing in fp32 (a bf16 model cast with `.float()`
    would keep its RoPE `inv_freq` buffer rounded to bf16)."""
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()


def _torch_logits(m: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return m.float()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def _params(folder: str) -> tuple[object, dict]:
    """(config, params tree as numpy fp32) read through the library from an HF folder."""
    opened = jobs.open_checkpoint(folder)
    tree = naming.hf_to_tree(opened.named, opened.config).params
    flat = {k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()}
    return opened.config, naming.nest(flat)


def _forward(cfg, params: dict) -> np.ndarray:
    """Our logits on one device, jitted (cfg is read when traced)."""
    return np.asarray(jax.jit(lambda p: models.forward(cfg, p, TOKENS))(params))


# --------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize(
    "name, mesh",
    cases([(name, mesh) for name in ("qwen2", "qwen3") for mesh in MESHES]
          + [("qwen2_tied", "tp=4,pp=2"), ("qwen3_bias_tied", "fsdp=2,tp=2,pp=2")]),
)
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(
        jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=ATOL, rtol=0
    )


def test_bf16_checkpoint_logits_in_fp32(hf_dirs):
    """bf16 weights widen exactly to fp32: our fp32 forward agrees with transformers' (the
    checkpoint loaded in fp32) within 1e-4."""
    folder, m = hf_dirs["qwen3_bf16"]
    np.testing.assert_allclose(
        jobs.logits(folder, TOKENS, mesh=fit("fsdp=2,tp=2,pp=2")), _torch_logits(m), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("name", ["qwen2_yarn", "qwen3_linear"])
def test_rope_scaling_is_read_and_matters(hf_dirs, name):
    """The config's rope scaling (read by Llama's reader) reaches the forward pass: logits equal
    transformers', and differ far beyond the tolerance with plain RoPE."""
    folder, m = hf_dirs[name]
    want = _torch_logits(m)
    np.testing.assert_allclose(
        jobs.logits(folder, TOKENS, mesh=fit("tp=4,pp=2")), want, atol=ATOL, rtol=0
    )
    cfg, params = _params(folder)
    assert cfg.rope_scaling is not None
    plain = dataclasses.replace(cfg, rope_scaling=None)
    assert np.abs(_forward(plain, params) - want).max() > 1000 * ATOL


def _drop(params: dict, leaves: list[tuple[str, str]]) -> dict:
    layers = {k: dict(v) for k, v in params["layers"].items()}
    for module, leaf in leaves:
        del layers[module][leaf]
        if not layers[module]:
            del layers[module]
    return {**params, "layers": layers}


def _zero(params: dict, leaves: list[tuple[str, str]]) -> dict:
    layers = {k: dict(v) for k, v in params["layers"].items()}
    for module, leaf in leaves:
        layers[module][leaf] = np.zeros_like(layers[module][leaf])
    return {**params, "layers": layers}


@pytest.mark.parametrize(
    "name, option, leaves",
    [
        ("qwen2", None, [("q", "bias"), ("k", "bias"), ("v", "bias")]),
        ("qwen3", "qk_norm", [("q_norm", "scale"), ("k_norm", "scale")]),
        ("qwen3_bias_tied", None, [("o", "bias")]),
    ],
)
def test_the_family_specific_part_matters(hf_dirs, monkeypatch, name, option, leaves):
    """With the biases or the q/k norms, our forward equals transformers'; without them it is
    far off: the part is really read and used. The q/k norms go with their option (off, the
    params gone); a bias, which the module adds wherever the family's table has one, is zeroed
    (what a projection without it computes)."""
    folder, m = hf_dirs[name]
    want = _torch_logits(m)
    cfg, params = _params(folder)
    np.testing.assert_allclose(_forward(cfg, params), want, atol=ATOL, rtol=0)
    if option is None:
        without = _forward(cfg, _zero(params, leaves))
    else:
        monkeypatch.setattr(type(cfg), option, False)
        without = _forward(cfg, _drop(params, leaves))
    assert np.abs(without - want).max() > 1000 * ATOL


# ------------------------------------------------------------------- import, export, reload


@pytest.mark.parametrize(
    "name, mesh_a, mesh_b",
    cases([
        ("qwen2", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"),
        ("qwen2_tied", "dp=1", "fsdp=2,tp=2,pp=2"),
        ("qwen3", "dp=1", "tp=4,pp=2"),
        ("qwen3_bias_tied", "fsdp=2,tp=2,pp=2", "dp=1"),
        ("qwen3_bf16", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"),
        ("qwen2_yarn", "tp=4,pp=2", "dp=1"),
        ("qwen3_linear", "dp=1", "fsdp=2,tp=2,pp=2"),
    ]),
)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(
    hf_dirs, tmp_path, name, mesh_a, mesh_b
):
    folder, m = hf_dirs[name]
    params, *_ = roundtrip(folder, tmp_path, mesh_a=mesh_a, mesh_b=mesh_b, optimizer=False)
    source = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    assert sorted(params) == sorted(source)
    for k, want in source.items():
        assert params[k].dtype == want.dtype and params[k].shape == want.shape, k
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k
    out = os.path.join(tmp_path, "exported")
    back = _load_fp32(out)
    assert type(back) is type(m)
    for key in ("head_dim", "attention_bias", "tie_word_embeddings", "num_key_value_heads",
                "rms_norm_eps", "rope_parameters", "use_sliding_window", "layer_types"):  # fmt: skip
        assert getattr(back.config, key, None) == getattr(m.config, key, None), key
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(m))


# ------------------------------------------------------------------------------ configs


def _hf_config(name: str) -> dict:
    model_cls, config_cls, overrides, _ = MODELS[name]
    return getattr(transformers, config_cls)(**SIZES, **overrides).to_dict()


def test_configs_read_and_written():
    q2 = models.config_from_hf(_hf_config("qwen2"))
    assert type(q2) is Qwen2Config and q2.family == "qwen2"
    assert (q2.head_dim, q2.rope_theta, q2.rms_norm_eps, q2.tie_word_embeddings) == (
        8,
        5000.0,
        1e-6,
        False,
    )
    q3 = models.config_from_hf(_hf_config("qwen3_bias_tied"))
    assert type(q3) is Qwen3Config and (q3.head_dim, q3.attention_bias, q3.tie_word_embeddings) == (
        12,
        True,
        True,
    )
    for cfg in (q2, q3):
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.rule_variables(cfg)["head_dim"] == cfg.head_dim
    assert q2 != models.LlamaConfig(**{f.name: getattr(q2, f.name) for f in dataclasses.fields(q2)})
    assert models.rule_variables(q3)["attention_bias"] is True
    # Qwen3 without head_dim: transformers' default 128, not hidden / heads
    d = _hf_config("qwen3")
    del d["head_dim"]
    assert models.config_from_hf(d).head_dim == 128
    assert (
        models.config_from_hf({**d, "architectures": None, "model_type": "qwen3"}).family == "qwen3"
    )


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_unimplemented_attention_is_refused(name):
    d = _hf_config(name)
    with pytest.raises(
        ConfigError, match="use_sliding_window=true .* sliding_window 4096 .*not implemented"
    ):
        models.config_from_hf(
            {**d, "use_sliding_window": True, "sliding_window": 4096}, source="c.json"
        )
    with pytest.raises(
        ConfigError, match=r"c.json: layer_types \['sliding_attention'\] are not implemented"
    ):
        models.config_from_hf(
            {**d, "layer_types": ["full_attention", "sliding_attention"]}, source="c.json"
        )
    with pytest.raises(ConfigError, match="c.json: .*needs keys.*missing \\['hidden_size'\\]"):
        models.config_from_hf({**d, "hidden_size": None}, source="c.json")
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        models.config_from_hf({**d, "hidden_act": "gelu"}, source="c.json")


# ---------------------------------------------------------------------------- param trees


def _expected_axes(cfg) -> dict:
    layers = {
        "attn_norm": {"scale": ("layers", None)},
        "q": {"kernel": ("layers", "embed", "heads")},
        "k": {"kernel": ("layers", "embed", "kv_heads")},
        "v": {"kernel": ("layers", "embed", "kv_heads")},
        "o": {"kernel": ("layers", "heads", "embed")},
        "mlp_norm": {"scale": ("layers", None)},
        "gate": {"kernel": ("layers", "embed", "mlp")},
        "up": {"kernel": ("layers", "embed", "mlp")},
        "down": {"kernel": ("layers", "mlp", "embed")},
    }
    if cfg.qkv_bias:
        layers["q"]["bias"] = ("layers", "heads")
        layers["k"]["bias"] = layers["v"]["bias"] = ("layers", "kv_heads")
    if cfg.o_bias:
        layers["o"]["bias"] = ("layers", None)
    if cfg.qk_norm:
        layers["q_norm"] = layers["k_norm"] = {"scale": ("layers", None)}
    tree = {
        "embed": {"embedding": ("vocab", "embed")},
        "layers": layers,
        "final_norm": {"scale": (None,)},
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = {"kernel": ("embed", "vocab")}
    return tree


@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied", "qwen3", "qwen3_bias_tied"])
def test_param_tree_and_logical_axes(name):
    cfg = models.config_from_hf(_hf_config(name))
    assert models.logical_axes(cfg) == _expected_axes(cfg)
    shapes = models.param_shape_tree(cfg)
    L, hd = cfg.num_layers, cfg.head_dim
    assert shapes["layers"]["q"]["kernel"] == (L, cfg.hidden_size, cfg.num_heads * hd)
    if cfg.qkv_bias:
        assert shapes["layers"]["k"]["bias"] == (L, cfg.num_kv_heads * hd)
    if cfg.qk_norm:
        assert shapes["layers"]["q_norm"]["scale"] == (L, hd)


def test_registry_and_rules():
    fams = models.families()
    assert fams["qwen2"].config_cls is Qwen2Config and fams["qwen3"].config_cls is Qwen3Config
    for name in ("qwen2", "qwen3"):
        cfg = models.config_from_hf(_hf_config(name))
        assert models.family_of(cfg).name == name
        assert models.hf_rules(cfg)[1] == f"models/{name}/params.py table"
    # the names transformers writes are exactly the ones the rules produce on export
    cfg = models.config_from_hf(_hf_config("qwen3_bias_tied"))
    names = set(naming.model_hf_shapes(cfg))
    assert "model.layers.1.self_attn.o_proj.bias" in names and "lm_head.weight" not in names
    assert json.dumps(models.config_to_hf(cfg))  # JSON-able
