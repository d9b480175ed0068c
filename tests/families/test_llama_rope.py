"""Llama with RoPE scaling (models/rope.py, models/llama) against transformers' LlamaForCausalLM.

Every rope type transformers implements that Llama checkpoints carry: default, linear, dynamic
(NTK), llama3, yarn. Tiny models are built and saved by transformers in this session (fp32
safetensors), every parameter drawn at random first. The scalings are chosen so that each one
changes the logits of a 16-token sequence (dynamic: max_position_embeddings 8 < 16; llama3 and
yarn: original_max_position_embeddings 16, below max_position_embeddings 64).

Tolerances: fp32 logits vs transformers atol 1e-4 (observed ~2e-6); inv_freq vs transformers'
`ROPE_INIT_FUNCTIONS` within 3 fp32 ulps (our fp32 pow is rounded once from fp64, torch's is
its own); an exported folder, loaded back by transformers, gives bit-identical logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from e2e import roundtrip
from meshes import cases, fit
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hybridckpt import jobs, models, naming
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama.config import META_LLAMA3_SCALING
from hybridckpt.models.rope import read_hf_rope, rope_frequencies

TOKENS = np.random.default_rng(0).integers(0, 96, (2, 16), dtype=np.int32)
ATOL = 1e-4
MESHES = ["dp=1", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"]
SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
# name -> (rope_parameters as transformers 5 takes them, config overrides)
ROPES = {
    "default": ({"rope_type": "default", "rope_theta": 5000.0}, {}),
    "linear": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}, {}),
    "dynamic": (
        {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 5000.0},
        {"max_position_embeddings": 8},
    ),
    "llama3": (
        {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0,
        },
        {},
    ),  # fmt: skip
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
        {},
    ),
}
SCALED = [name for name in ROPES if name != "default"]
# The transformers-4 spelling of each scaling: top-level rope_theta, `rope_scaling` without it
# (linear in the legacy `type` key, as Llama 2 era configs wrote it).
V4_SCALING = {
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {k: v for k, v in ROPES["llama3"][0].items() if k != "rope_theta"},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


def _hf_config(name: str) -> transformers.LlamaConfig:
    rope, overrides = ROPES[name]
    kw = {**SIZES, **overrides, "rope_parameters": dict(rope)}
    return transformers.LlamaConfig(**kw, attn_implementation="eager")


def _build(name: str, seed: int) -> torch.nn.Module:
    m = transformers.LlamaForCausalLM(_hf_config(name)).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            centre = 1.0 if pname.endswith("norm.weight") else 0.0
            p.normal_(centre, 0.15 if p.ndim > 1 else 0.3)
    return m


def _load(folder) -> torch.nn.Module:
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()


def _torch_logits(m: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def _read_config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _write_v4(folder: str, dst: str, name: str) -> str:
    """A copy of `folder` whose config.json says its RoPE as transformers 4 did."""
    shutil.copytree(folder, dst)
    d = _read_config(dst)
    theta = d.pop("rope_parameters")["rope_theta"]
    d |= {"rope_theta": theta, "rope_scaling": V4_SCALING[name]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(d, f)
    return dst


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers, its model)."""
    out = {}
    for seed, name in enumerate(ROPES):
        m = _build(name, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


# --------------------------------------------------------------------------- frequencies

FREQ_CASES = [
    (None, 10000.0, 64),
    ({"rope_type": "linear", "factor": 2.5}, 10000.0, 64),
    ({"type": "dynamic", "factor": 3.0}, 5000.0, 64),
    (dict(META_LLAMA3_SCALING), 500000.0, 131072),
    ({**ROPES["llama3"][0], "original_max_position_embeddings": 32}, 10000.0, 64),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1e6, 131072),
    (
        {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1},
        10000.0, 163840,
    ),  # fmt: skip
    (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
         "attention_factor": 0.9, "truncate": False},
        10000.0, 128,
    ),  # fmt: skip
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32}, 10000.0, 128),
]


@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("case", range(len(FREQ_CASES)))
def test_inv_freq_and_attention_scaling_equal_transformers(case, head_dim):
    scaling, theta, max_pos = FREQ_CASES[case]
    c = transformers.LlamaConfig(
        **{**SIZES, "hidden_size": 4 * head_dim, "max_position_embeddings": max_pos}, head_dim=head_dim,
        rope_parameters={**(scaling or {}), "rope_theta": theta},
    )  # fmt: skip
    kind = c.rope_parameters["rope_type"]
    for seq in (None, max_pos // 2, max_pos + 7, 3 * max_pos) if kind == "dynamic" else (None,):
        if kind == "default":
            want, want_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(c)
        elif seq is None:
            want, want_scale = ROPE_INIT_FUNCTIONS[kind](c)
        else:  # dynamic: what the rotary embedding holds after a forward over seq positions
            emb = LlamaRotaryEmbedding(c)
            emb(torch.zeros(1), torch.arange(seq)[None])
            want, want_scale = emb.inv_freq, emb.attention_scaling
        got, scale = rope_frequencies(head_dim, theta, scaling, seq, max_position_embeddings=max_pos)
        want = want.numpy()
        assert got.dtype == np.float32 and got.shape == want.shape == (head_dim // 2,)
        ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
        assert ulps.max() <= 3, (kind, seq, ulps)
        assert scale == pytest.approx(want_scale, rel=1e-12)


def test_dynamic_only_scales_beyond_max_positions():
    plain, _ = rope_frequencies(8, 5000.0, None)
    scaling = {"rope_type": "dynamic", "factor": 4.0}
    short, _ = rope_frequencies(8, 5000.0, scaling, 8, max_position_embeddings=8)
    long, _ = rope_frequencies(8, 5000.0, scaling, 16, max_position_embeddings=8)
    assert np.array_equal(short, plain) and not np.allclose(long, plain, rtol=1e-3)


# --------------------------------------------------------------------------- forward parity


# every rope type on at least one mesh, every mesh with scaled RoPE (the tables are replicated
# constants, so the mesh and the rope type do not interact: this keeps the file fast)
@pytest.mark.parametrize(
    "name, mesh",
    cases([("default", MESHES[0]), ("linear", MESHES[1]), ("dynamic", MESHES[2]), ("llama3", MESHES[0]),
           ("llama3", MESHES[2]), ("yarn", MESHES[1]), ("yarn", MESHES[2])]),
)  # fmt: skip
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    got = jobs.logits(folder, TOKENS, mesh=mesh)
    np.testing.assert_allclose(got, _torch_logits(m), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", SCALED)
def test_the_rope_scaling_matters(hf_dirs, name):
    """With the scaling our forward equals transformers'; without it (plain RoPE of the same
    theta) the logits are far off: the scaling is really read and used."""
    folder, m = hf_dirs[name]
    want = _torch_logits(m)
    opened = jobs.open_checkpoint(folder)
    cfg = opened.config
    assert cfg.rope_scaling is not None and dict(cfg.rope_scaling)["rope_type"] == name
    tree = naming.hf_to_tree(opened.named, cfg).params
    params = naming.nest({k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()})
    with_scaling = np.asarray(jax.jit(lambda p: models.forward(cfg, p, TOKENS))(params))
    np.testing.assert_allclose(with_scaling, want, atol=ATOL, rtol=0)
    plain = dataclasses.replace(cfg, rope_scaling=None)
    without = np.asarray(models.forward(plain, params, TOKENS))
    assert np.abs(without - want).max() > 1000 * ATOL


# ------------------------------------------------------------------- import, export, reload


@pytest.mark.parametrize("form", ["v5", "v4"])
@pytest.mark.parametrize("name", SCALED)
def test_scaling_survives_import_export_and_loads_in_transformers(hf_dirs, tmp_path, name, form):
    """import -> restore on another mesh -> export is bitwise; the exported config.json holds
    the scaling exactly as read (v5: `rope_parameters`; v4: `rope_theta` + `rope_scaling`), and
    transformers loads it back to the same rope_parameters and the same logits."""
    folder, m = hf_dirs[name]
    if form == "v4":
        folder = _write_v4(folder, str(tmp_path / "v4"), name)
        m = _load(folder)
    original = _read_config(folder)
    mesh_a, mesh_b = ("dp=1", "fsdp=2,tp=2,pp=2") if form == "v4" else ("fsdp=2,tp=2,pp=2", "tp=4,pp=2")
    params, *_ = roundtrip(folder, tmp_path, mesh_a=mesh_a, mesh_b=mesh_b, optimizer=False)
    out = os.path.join(tmp_path, "exported")
    exported = _read_config(out)
    if form == "v5":
        assert exported["rope_parameters"] == original["rope_parameters"]
    else:
        assert "rope_parameters" not in original
        assert exported["rope_scaling"] == original["rope_scaling"]
        assert exported["rope_theta"] == original["rope_theta"]
    assert models.config_from_hf(exported) == models.config_from_hf(original)
    back = _load(out)
    assert back.config.rope_parameters == m.config.rope_parameters
    assert back.config.max_position_embeddings == m.config.max_position_embeddings
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(m))


# ------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("name", SCALED)
def test_config_forms_read_alike_and_survive_our_json(name):
    rope, overrides = ROPES[name]
    v5 = {**_hf_config(name).to_dict(), "architectures": ["LlamaForCausalLM"]}
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4 |= {"rope_theta": rope["rope_theta"], "rope_scaling": V4_SCALING[name]}
    a, b = models.config_from_hf(v5), models.config_from_hf(v4)
    assert a.rope_theta == b.rope_theta == rope["rope_theta"]
    assert dict(b.rope_scaling) == V4_SCALING[name]  # kept as read
    for cfg, source in ((a, v5), (b, v4)):
        hash(cfg)  # a jax.jit cache key
        back = models.config_from_dict(json.loads(json.dumps(models.config_to_dict(cfg))))
        assert back == cfg and hash(back) == hash(cfg)
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.LlamaConfig(**dataclasses.asdict(cfg)) == cfg
        # what transformers makes of our config.json is what it makes of the source's
        ours = transformers.LlamaConfig.from_dict(models.config_to_hf(cfg)).rope_parameters
        assert ours == transformers.LlamaConfig.from_dict(source).rope_parameters


def test_rope_keys_precedence_as_transformers():
    # a non-empty rope_scaling wins over rope_parameters; the dict's rope_theta over the top one
    d = {"rope_theta": 1.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
         "rope_parameters": {"rope_type": "yarn", "factor": 3.0}}  # fmt: skip
    assert read_hf_rope(d, "c.json") == (1.0, (("factor", 2.0), ("rope_type", "linear")))
    d = {"rope_theta": 1.0, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 7}}
    assert read_hf_rope(d, "c.json") == (7.0, None)
    assert read_hf_rope({}, "c.json") == (10000.0, None)
    assert read_hf_rope({"rope_scaling": {}, "rope_theta": 3}, "c.json") == (3.0, None)


@pytest.mark.parametrize(
    "rope, words",
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, ["'longrope' is not implemented"]),
        ({"rope_type": "llama3", "factor": 8.0}, ["'llama3' needs keys", "low_freq_factor"]),
        ({"rope_type": "yarn", "rope_theta": 1.0}, ["'yarn' needs keys", "'factor'"]),
        ({"rope_type": "linear", "factor": "2"}, ["factor must be a positive number"]),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, ["'linear' has unknown keys ['beta_fast']"]),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, ["partial_rotary_factor 0.5"]),
        ({"rope_type": "dynamic", "type": "linear", "factor": 2.0}, ["disagrees with type"]),
        ([1, 2], ["rope_parameters must be an object or null"]),
    ],
)
def test_bad_rope_dicts_are_refused_by_name(rope, words):
    d = {**_hf_config("default").to_dict(), "architectures": ["LlamaForCausalLM"], "rope_parameters": rope}
    with pytest.raises(ConfigError) as e:
        models.config_from_hf(d, source="ckpt/config.json")
    assert "ckpt/config.json: rope_parameters" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_config_fields_are_checked():
    base = models.config_from_hf({**_hf_config("linear").to_dict(), "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="rope_theta 1.0 disagrees with rope_theta 5000.0"):
        dataclasses.replace(base, rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0})
    with pytest.raises(ConfigError, match="LlamaConfig.rope_scaling: expected an object or null"):
        dataclasses.replace(base, rope_scaling=3)
    # a dict that only restates plain RoPE is plain RoPE
    assert dataclasses.replace(base, rope_scaling={"rope_type": "default"}).rope_scaling is None


# ------------------------------------------------------------------------- Meta params.json


def test_meta_use_scaled_rope_is_hf_llama3(tmp_path):
    """Meta's `use_scaled_rope: true` is HF's llama3 rope type with the factors of Meta's
    reference `apply_scaling` (8, 1, 4, 8192): same config, inv_freq and logits as transformers'
    LlamaForCausalLM with the rope_scaling of HF's Llama 3.1 conversions."""
    from fixtures.meta_writer import meta_llama_reference, write_meta

    ref = meta_llama_reference(seed=7)
    ref.config["rope_theta"] = 500000.0
    write_meta(str(tmp_path), ref, mp=2, generation=3)
    with open(tmp_path / "params.json") as f:
        params = json.load(f)
    with open(tmp_path / "params.json", "w") as f:
        json.dump({**params, "use_scaled_rope": True}, f)
    cfg = jobs.open_checkpoint(str(tmp_path)).config
    hf_31 = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
             "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
    assert dict(cfg.rope_scaling) == hf_31 and cfg.rope_theta == 500000.0
    assert models.config_to_hf(cfg)["rope_scaling"] == hf_31
    # without rope_theta in params.json, Llama 3's ModelArgs default applies
    no_theta = {k: v for k, v in params.items() if k != "rope_theta"}
    assert models.config_from_meta_params({**no_theta, "use_scaled_rope": True}).rope_theta == 500000.0
    assert models.config_from_meta_params(no_theta).rope_theta == 10000.0
    with pytest.raises(ConfigError, match="p.json: use_scaled_rope must be true or false"):
        models.config_from_meta_params({**params, "use_scaled_rope": "yes"}, source="p.json")

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps")  # fmt: skip
    hf_cfg = transformers.LlamaConfig(
        **{k: ref.config[k] for k in keys}, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=500000.0, rope_scaling=dict(hf_31), attn_implementation="eager",
    )  # fmt: skip
    want_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    got_freq, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_array_equal(got_freq, want_freq.numpy())
    plain_freq, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta, None)
    assert not np.array_equal(got_freq, plain_freq)
    m = transformers.LlamaForCausalLM(hf_cfg).eval()
    m.load_state_dict({k: torch.from_numpy(v) for k, v in ref.weights.items()})
    got = jobs.logits(str(tmp_path), TOKENS, mesh=fit("fsdp=2,tp=2,pp=2"))
    np.testing.assert_allclose(got, _torch_logits(m), atol=ATOL, rtol=0)
