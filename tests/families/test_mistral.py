"""models/mistral against transformers' own MistralForCausalLM.

Tiny models are built and saved by transformers in this session (fp32 safetensors), every
parameter drawn at random first. The sliding window (4 and 6) is shorter than the 16-token test
sequence, so it changes attention; one model also has an explicit head_dim (Mistral NeMo
style: heads * head_dim != hidden) and linear RoPE scaling, which Mistral shares with Llama.

Tolerances: fp32 logits vs transformers atol 1e-4 (observed ~2e-6); the exported folder, loaded
back by transformers, gives bit-identical logits.
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
from meshes import cases

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.mistral.config import MistralConfig

TOKENS = np.random.default_rng(1).integers(0, 96, (2, 16), dtype=np.int32)
ATOL = 1e-4
MESHES = ["dp=1", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"]
SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
MODELS = {
    "mistral": {"sliding_window": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
    "mistral_nemo_linear": {
        "sliding_window": 6, "head_dim": 12,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    },  # fmt: skip
    "mistral_no_window": {"sliding_window": None},
}


def _hf_config(name: str) -> transformers.MistralConfig:
    return transformers.MistralConfig(**SIZES, **MODELS[name], attn_implementation="eager")


def _build(name: str, seed: int) -> torch.nn.Module:
    m = transformers.MistralForCausalLM(_hf_config(name)).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            centre = 1.0 if pname.endswith("norm.weight") else 0.0
            p.normal_(centre, 0.15 if p.ndim > 1 else 0.3)
    return m


def _torch_logits(m: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers, its model)."""
    out = {}
    for seed, name in enumerate(MODELS):
        m = _build(name, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


# --------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize(
    "name, mesh",
    cases([("mistral", m) for m in MESHES] + [("mistral_nemo_linear", MESHES[2]), ("mistral_no_window", MESHES[1])]),
)
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["mistral", "mistral_nemo_linear"])
def test_the_sliding_window_matters(hf_dirs, name):
    """With the window our forward equals transformers'; without it (plain causal) it is far
    off; a window as long as the sequence is plain causal attention."""
    folder, m = hf_dirs[name]
    want = _torch_logits(m)
    opened = jobs.open_checkpoint(folder)
    cfg = opened.config
    assert type(cfg) is MistralConfig and cfg.sliding_window < TOKENS.shape[1]
    tree = naming.hf_to_tree(opened.named, cfg).params
    params = naming.nest({k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()})
    forward = jax.jit(models.forward, static_argnums=0)
    np.testing.assert_allclose(np.asarray(forward(cfg, params, TOKENS)), want, atol=ATOL, rtol=0)
    without = np.asarray(forward(dataclasses.replace(cfg, sliding_window=None), params, TOKENS))
    assert np.abs(without - want).max() > 1000 * ATOL
    full = dataclasses.replace(cfg, sliding_window=TOKENS.shape[1])
    np.testing.assert_allclose(np.asarray(forward(full, params, TOKENS)), without, atol=1e-6, rtol=0)


# ------------------------------------------------------------------- import, export, reload


@pytest.mark.parametrize(
    "name, mesh_a, mesh_b",
    cases([("mistral", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"), ("mistral_nemo_linear", "dp=1", "fsdp=2,tp=2,pp=2")]),
)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name, mesh_a, mesh_b):
    folder, m = hf_dirs[name]
    params, *_ = roundtrip(folder, tmp_path, mesh_a=mesh_a, mesh_b=mesh_b, optimizer=False)
    source = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    assert sorted(params) == sorted(source)
    for k, want in source.items():
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k
    out = os.path.join(tmp_path, "exported")
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    back = transformers.AutoModelForCausalLM.from_pretrained(out, **kw).eval()
    assert type(back) is transformers.MistralForCausalLM
    for key in ("sliding_window", "head_dim", "rope_parameters", "num_key_value_heads",
                "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):  # fmt: skip
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(m))


# ------------------------------------------------------------------------------ configs


def test_configs_read_and_written():
    for name in MODELS:
        d = _hf_config(name).to_dict()
        cfg = models.config_from_hf(d)
        assert type(cfg) is MistralConfig and cfg.family == "mistral"
        assert cfg.sliding_window == MODELS[name]["sliding_window"]
        assert models.config_from_dict(json.loads(json.dumps(models.config_to_dict(cfg)))) == cfg
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.family_of(cfg).name == "mistral"
        hf = models.config_to_hf(cfg)
        assert "attention_bias" not in hf and hf["architectures"] == ["MistralForCausalLM"]
    nemo = models.config_from_hf(_hf_config("mistral_nemo_linear").to_dict())
    assert nemo.head_dim == 12 and dict(nemo.rope_scaling)["rope_type"] == "linear"
    # absent keys take transformers' MistralConfig defaults, not Llama's
    d = _hf_config("mistral").to_dict()
    del d["sliding_window"], d["max_position_embeddings"]
    cfg = models.config_from_hf({**d, "architectures": None})
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (4096, 131072)
    # a Mistral is not a Llama, though it has the same fields and tensors
    llama = models.LlamaConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(models.LlamaConfig)})
    assert llama != cfg and models.family_of(llama).name == "llama"
    assert models.rule_variables(cfg) == models.rule_variables(llama)
    assert models.param_shape_tree(cfg) == models.param_shape_tree(llama)


def test_rules_and_tree_are_llamas_table():
    cfg = models.config_from_hf(_hf_config("mistral_nemo_linear").to_dict())
    assert models.hf_rules(cfg)[1] == "models/llama/params.py table"
    shapes = models.param_shape_tree(cfg)
    assert shapes["layers"]["q"]["kernel"] == (2, 32, 4 * 12)
    assert models.logical_axes(cfg)["layers"]["k"]["kernel"] == ("layers", "embed", "kv_heads")


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "4"])
def test_bad_sliding_window_is_refused(window):
    d = {**_hf_config("mistral").to_dict(), "sliding_window": window}
    with pytest.raises(ConfigError, match="sliding_window: expected a positive int or None"):
        models.config_from_hf(d, source="c.json")


def test_missing_keys_name_mistral():
    with pytest.raises(ConfigError, match=r"c.json: MistralForCausalLM config needs keys.*'hidden_size'"):
        models.config_from_hf({"architectures": ["MistralForCausalLM"], "vocab_size": 8}, source="c.json")
