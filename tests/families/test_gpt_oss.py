"""models/gpt_oss against transformers' own GptOssForCausalLM (the oracle), on meshes fitted to
the devices present (tp=4 and pp=2 where there are 8).

Tiny models are built and saved by transformers in this session (fp32 safetensors under the
runtime names `mlp.experts.gate_up_proj` `[X, E, 2M]` etc., which `save_pretrained` writes for
GPT-OSS), every parameter drawn at random first: the routers with a wide spread so that the
top-k choice differs across tokens (asserted from transformers' router logits), the sinks of
order 1, and in `gpt_oss_clamped` a small `swiglu_limit` so the clamps act. Tolerances: fp32
logits vs transformers atol 1e-4 (transformers' own fp32 forward differs from its float64 one
by a few 1e-5 on the MXFP4 release case: `tests/real/test_real_hf_quantized.py`); the
exported folder, loaded back by transformers, gives bit-identical logits. Each GPT-OSS part
(sinks, sliding layers, yarn, top-k, router / expert / attention biases, the gate/up
interleave, the clamp and alpha) is turned off in turn: logits move far beyond the tolerance.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from e2e import roundtrip
from safetensors.numpy import save_file

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source
from hybridckpt.models.gpt_oss.config import GptOssConfig

TOKENS = np.random.default_rng(3).integers(0, 96, (2, 12), dtype=np.int32)
ATOL = 1e-4
SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0},
)  # fmt: skip
MODELS = {
    "gpt_oss": {},
    "gpt_oss_clamped": {"swiglu_limit": 0.6, "num_local_experts": 6, "num_experts_per_tok": 3},
}


def meshes() -> list[str]:
    """Meshes for the devices present: tp=4 with pp=2 (and experts over dp) where 8 are."""
    n = jax.device_count()
    if n >= 8:
        return ["tp=4,pp=2", "dp=2,fsdp=2,tp=2", "dp=4,pp=2"]
    if n >= 4:
        return ["tp=4", "tp=2,pp=2", "dp=2,tp=2"]
    if n >= 2:
        return ["tp=2", "pp=2"]
    return ["dp=1"]


def _build(name: str, seed: int) -> torch.nn.Module:
    cfg = transformers.GptOssConfig(**{**SIZES, **MODELS[name]}, attn_implementation="eager")
    m = transformers.GptOssForCausalLM(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if pname.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif pname.endswith(("router.weight", "sinks")):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.15 if p.ndim > 1 else 0.3)
    return m.eval()


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


def _tree_params(folder):
    opened = jobs.open_checkpoint(folder)
    tree = naming.hf_to_tree(opened.named, opened.config).params
    return opened.config, naming.nest({k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()})


# --------------------------------------------------------------------------- forward parity


def test_saved_names_are_the_runtime_names(hf_dirs):
    src = open_source(hf_dirs["gpt_oss"][0])
    assert tuple(src.tensors["model.layers.3.mlp.experts.gate_up_proj"].shape) == (4, 32, 48)
    assert tuple(src.tensors["model.layers.3.mlp.experts.down_proj"].shape) == (4, 24, 32)
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias"} <= set(src.tensors)
    assert type(src.config) is GptOssConfig
    assert src.config.layer_types == ("sliding_attention", "full_attention") * 2


@pytest.mark.parametrize("name", list(MODELS))
def test_top_k_choices_differ_across_tokens(hf_dirs, name):
    _, m = hf_dirs[name]
    with torch.no_grad():
        out = m(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True)
    k = m.config.num_experts_per_tok
    for layer in out.router_logits:
        chosen = {tuple(sorted(r)) for r in torch.topk(layer, k, dim=-1).indices.tolist()}
        assert len(chosen) >= 3, chosen


@pytest.mark.parametrize("name, mesh", [("gpt_oss", m) for m in meshes()] + [("gpt_oss_clamped", meshes()[0])])
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=ATOL, rtol=0)


def _without(params: dict, group: str, path: tuple[str, ...], fn) -> dict:
    """`params` with the leaf at params[group][path...] replaced by fn(leaf)."""
    out = {**params, group: dict(params[group])}
    node = out[group]
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    node[path[-1]] = fn(node[path[-1]])
    return out


def _changes(name: str, cfg: GptOssConfig, params: dict) -> dict:
    """Each GPT-OSS part turned off: (config, params) per part."""
    zero = np.zeros_like
    m = cfg.intermediate_size

    def halves(k):  # the columns as `[gate | up]` halves, read as (gate, up) pairs
        return np.stack([k[..., :m], k[..., m:]], axis=-1).reshape(k.shape)

    out = {
        "sinks": (cfg, _without(params, "layers", ("sinks",), lambda s: np.full_like(s, -1e30))),
        "sliding layers": (dataclasses.replace(cfg, layer_types=("full_attention",) * cfg.num_layers), params),
        "yarn": (dataclasses.replace(cfg, rope_scaling=None), params),
        "top-k": (dataclasses.replace(cfg, num_experts_per_tok=cfg.num_experts), params),
        "router bias": (cfg, _without(params, "moe", ("router", "bias"), zero)),
        "gate_up bias": (cfg, _without(params, "moe", ("experts", "gate_up", "bias"), zero)),
        "down bias": (cfg, _without(params, "moe", ("experts", "down", "bias"), zero)),
        "q bias": (cfg, _without(params, "layers", ("q", "bias"), zero)),
        "k bias": (cfg, _without(params, "layers", ("k", "bias"), zero)),
        "v bias": (cfg, _without(params, "layers", ("v", "bias"), zero)),
        "o bias": (cfg, _without(params, "layers", ("o", "bias"), zero)),
        "interleave": (cfg, _without(params, "moe", ("experts", "gate_up", "kernel"), halves)),
        "alpha": (dataclasses.replace(cfg, swiglu_alpha=1.0), params),
    }
    if name == "gpt_oss_clamped":
        out["clamp"] = (dataclasses.replace(cfg, swiglu_limit=1e9), params)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_each_gpt_oss_part_matters(hf_dirs, name):
    """The forward with the table's params equals transformers; each part turned off moves the
    logits far beyond the tolerance (what the parity test checks can fail)."""
    folder, m = hf_dirs[name]
    want = _torch_logits(m)
    cfg, params = _tree_params(folder)
    forward = jax.jit(models.forward, static_argnums=0)
    np.testing.assert_allclose(np.asarray(forward(cfg, params, TOKENS)), want, atol=ATOL, rtol=0)
    for part, (c, p) in _changes(name, cfg, params).items():
        assert np.abs(np.asarray(forward(c, p, TOKENS)) - want).max() > 100 * ATOL, part


# ------------------------------------------------------------------- import, export, reload


def _write_adamw_moments(m: torch.nn.Module, folder: str) -> None:
    """One real torch AdamW step on `m`; its moments as hybridckpt's `optimizer.safetensors`
    under the names save_pretrained writes (GPT-OSS's runtime names, no conversion)."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    t = torch.tensor(TOKENS, dtype=torch.long)
    m(t, labels=t).loss.backward()
    opt.step()
    moments = {f"{n}.{s}": opt.state[p][s].numpy() for n, p in m.named_parameters() for s in ("exp_avg", "exp_avg_sq")}
    save_file(moments | {"step": np.array(1.0, np.float32)}, os.path.join(folder, "optimizer.safetensors"))


def test_import_restore_export_with_adamw_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path):
    folder, m = hf_dirs["gpt_oss"]
    work = tmp_path / "src"
    work.mkdir()
    for f in os.listdir(folder):
        os.symlink(os.path.join(folder, f), work / f)
    trained = _build("gpt_oss", 0).train()
    trained.load_state_dict(m.state_dict())
    _write_adamw_moments(trained, str(work))
    mesh_a, mesh_b = (meshes() * 2)[:2]
    if mesh_a == mesh_b:  # one device: nothing to reshard
        jobs.import_checkpoint(str(work), str(tmp_path / "orbax"), mesh=mesh_a)
        jobs.export_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "exported"), optimizer=True)
        exported = open_source(str(tmp_path / "exported"))
        params = {k: v.materialize() for k, v in exported.tensors.items()}
        mu = {k: v.materialize() for k, v in exported.optimizer.slots["exp_avg"].items()}
        nu = {k: v.materialize() for k, v in exported.optimizer.slots["exp_avg_sq"].items()}
        step = exported.optimizer.step
    else:
        params, mu, nu, step = roundtrip(str(work), tmp_path, mesh_a=mesh_a, mesh_b=mesh_b)
    src = open_source(str(work))
    assert sorted(params) == sorted(src.tensors)
    for k, want in src.tensors.items():
        assert np.array_equal(params[k].view(np.uint8), want.materialize().view(np.uint8)), k
    for slot, got in (("exp_avg", mu), ("exp_avg_sq", nu)):
        for k, want in src.optimizer.slots[slot].items():
            assert np.array_equal(got[k].view(np.uint8), want.materialize().view(np.uint8)), (slot, k)
    assert step == 1
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "exported", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(back) is transformers.GptOssForCausalLM
    for key in ("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types", "rope_parameters",
                "swiglu_alpha", "swiglu_limit", "attention_bias", "head_dim"):
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(m))


def test_tree_and_axes_of_the_experts():
    cfg = models.config_from_hf(transformers.GptOssConfig(**SIZES).to_dict())
    shapes, axes = models.param_shape_tree(cfg), models.logical_axes(cfg)
    assert shapes["moe"]["experts"]["gate_up"]["kernel"] == (4, 4, 32, 48)
    assert axes["moe"]["experts"]["gate_up"]["kernel"] == ("layers", "experts", "embed", "mlp")
    assert shapes["moe"]["experts"]["gate_up"]["bias"] == (4, 4, 48)
    assert shapes["moe"]["experts"]["down"]["kernel"] == (4, 4, 24, 32)
    assert shapes["layers"]["sinks"] == (4, 4) and axes["layers"]["sinks"] == ("layers", "heads")
    assert shapes["moe"]["router"]["bias"] == (4, 4)


# ------------------------------------------------------------------------------ configs


def test_configs_read_and_written():
    for name in MODELS:
        d = transformers.GptOssConfig(**{**SIZES, **MODELS[name]}).to_dict()
        cfg = models.config_from_hf(d)
        assert type(cfg) is GptOssConfig
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    bare = {"architectures": ["GptOssForCausalLM"], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 24,
            "num_hidden_layers": 3, "num_attention_heads": 4}  # fmt: skip
    cfg = models.config_from_hf(bare)
    tf = transformers.GptOssConfig(**{k: v for k, v in bare.items() if k != "architectures"})
    assert cfg.layer_types == tuple(tf.layer_types) == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.sliding_window) == (128, 4, 128)
    assert (cfg.head_dim, cfg.rope_theta, cfg.num_kv_heads) == (tf.head_dim, 150000.0, 4)
    assert dict(cfg.rope_scaling) | {"rope_theta": 150000.0} == tf.rope_parameters


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["sliding_attention"]}, "layer_types: expected 3 entries"),
        ({"layer_types": ["full_attention", "chunked", "full_attention"]}, "found \\['chunked'\\]"),
        ({"num_experts_per_tok": 9, "num_local_experts": 8}, "num_experts_per_tok 9 exceeds num_experts 8"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_bad_configs_are_one_line_errors(change, message):
    from hybridckpt.errors import ConfigError

    d = {"architectures": ["GptOssForCausalLM"], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 24,
         "num_hidden_layers": 3, "num_attention_heads": 4, **change}  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        models.config_from_hf(d, source="x/config.json")


def test_a_tp_shard_keeps_each_gate_up_pair_with_its_down_row(hf_dirs, tmp_path):
    """On a mesh with tp, each device's columns of the interleaved gate_up are exactly the
    (gate j, up j) pairs of the down rows j it holds: the expert MLP needs no exchange."""
    from hybridckpt.jobs.restore import restore

    mesh = next((m for m in meshes() if "tp=" in m), None) or "dp=1"
    jobs.import_checkpoint(hf_dirs["gpt_oss"][0], str(tmp_path / "store"), mesh=mesh)
    _, r = restore(str(tmp_path / "store"), mesh, optimizer=False)
    experts = r.params["moe"]["experts"]
    gate_up = experts["gate_up"]["kernel"].sharding.devices_indices_map((4, 4, 32, 48))
    down = experts["down"]["kernel"].sharding.devices_indices_map((4, 4, 24, 32))
    tp = dict(s.split("=") for s in mesh.split(",")).get("tp", "1")
    widths = set()
    for dev, idx in gate_up.items():
        cols, rows = idx[3], down[dev][2]
        widths.add((cols.stop or 48) - (cols.start or 0))
        assert ((cols.start or 0), (cols.stop or 48)) == (2 * (rows.start or 0), 2 * (rows.stop or 24)), dev
    assert widths == {48 // int(tp)}
