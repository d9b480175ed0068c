"""models/mixtral against transformers' own MixtralForCausalLM, with experts split over devices.

Tiny models are built and saved by transformers in this session (fp32 safetensors; transformers
5 writes the Hub's per-expert names `block_sparse_moe.experts.E.w1.weight`), every parameter
drawn at random first, the router with a large spread so that the top-k choice differs across
tokens (asserted from transformers' own router logits). Tolerances: fp32 logits vs transformers
atol 1e-4; the exported folder, loaded back by transformers, gives bit-identical logits.
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
from fixtures.hf_moe import randomize, write_adamw_moments
from meshes import cases, fit, fit_pair, size, spec

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source
from hybridckpt.io.byte_source import count_reads
from hybridckpt.jobs.restore import restore
from hybridckpt.models.mixtral.config import MixtralConfig

TOKENS = np.random.default_rng(1).integers(0, 96, (2, 12), dtype=np.int32)
ATOL = 1e-4
MESHES = ["dp=2,fsdp=2,tp=2", "dp=4,pp=2", "dp=1", "tp=4,pp=2"]
SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    num_local_experts=4, num_experts_per_tok=2,
)  # fmt: skip
MODELS = {
    "mixtral": {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
    "mixtral_window": {"sliding_window": 5, "num_local_experts": 8, "num_experts_per_tok": 3},
}


def _hf_config(name: str) -> transformers.MixtralConfig:
    return transformers.MixtralConfig(**{**SIZES, **MODELS[name]}, attn_implementation="eager")


def _build(name: str, seed: int) -> torch.nn.Module:
    return randomize(transformers.MixtralForCausalLM(_hf_config(name)), seed)


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


def test_saved_names_are_the_hubs_per_expert_names(hf_dirs):
    names = set(open_source(hf_dirs["mixtral"][0]).tensors)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any("gate_up_proj" in n for n in names)


@pytest.mark.parametrize("name", list(MODELS))
def test_top_k_choices_differ_across_tokens(hf_dirs, name):
    _, m = hf_dirs[name]
    with torch.no_grad():
        out = m(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True)
    k = m.config.num_experts_per_tok
    for layer in out.router_logits:
        chosen = {tuple(sorted(r)) for r in torch.topk(layer, k, dim=-1).indices.tolist()}
        assert len(chosen) >= 3, chosen  # not one choice for every token


@pytest.mark.parametrize("name, mesh", cases([("mixtral", m) for m in MESHES] + [("mixtral_window", MESHES[0])], keep="dp"))
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=ATOL, rtol=0)


def test_expert_order_and_window_matter(hf_dirs):
    """Experts permuted (router unchanged) or the window dropped: logits far beyond tolerance."""
    folder, m = hf_dirs["mixtral_window"]
    want = _torch_logits(m)
    cfg, params = _tree_params(folder)
    forward = jax.jit(models.forward, static_argnums=0)
    np.testing.assert_allclose(np.asarray(forward(cfg, params, TOKENS)), want, atol=ATOL, rtol=0)
    perm = np.roll(np.arange(cfg.num_experts), 1)
    experts = {k: {"kernel": v["kernel"][:, perm]} for k, v in params["moe"]["experts"].items()}
    permuted = params | {"moe": params["moe"] | {"experts": experts}}
    assert np.abs(np.asarray(forward(cfg, permuted, TOKENS)) - want).max() > 1000 * ATOL
    no_window = np.asarray(forward(dataclasses.replace(cfg, sliding_window=None), params, TOKENS))
    assert np.abs(no_window - want).max() > 1000 * ATOL


# ------------------------------------------------------------------- import, export, reload


def test_import_reads_each_expert_once(hf_dirs, tmp_path):
    folder, _ = hf_dirs["mixtral"]
    path = os.path.join(folder, "model.safetensors")
    src = open_source(folder)
    data = sum(t.nbytes for t in src.tensors.values())
    with count_reads() as c:
        jobs.import_checkpoint(folder, str(tmp_path / "ckpt"), mesh=fit("dp=2,fsdp=2,tp=2", keep="dp"))
    header = os.path.getsize(path) - data
    assert c[path] == header + data  # the header once, every tensor's bytes exactly once


def test_import_restore_export_with_adamw_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path):
    folder, m = hf_dirs["mixtral"]
    work = tmp_path / "src"
    work.mkdir()
    for f in os.listdir(folder):
        os.symlink(os.path.join(folder, f), work / f)
    trained = _build("mixtral", 0)
    trained.load_state_dict(m.state_dict())
    write_adamw_moments("mixtral", trained, TOKENS, str(work))
    mesh_b, mesh_a = fit_pair("dp=4,pp=2", "dp=2,fsdp=2,tp=2", keep="dp")  # mesh B keeps dp first
    params, mu, nu, step = roundtrip(str(work), tmp_path, mesh_a=mesh_a, mesh_b=mesh_b)
    src = open_source(str(work))
    for k, want in src.tensors.items():
        assert np.array_equal(params[k].view(np.uint8), want.materialize().view(np.uint8)), k
    for slot, got in (("exp_avg", mu), ("exp_avg_sq", nu)):
        for k, want in src.optimizer.slots[slot].items():
            assert np.array_equal(got[k].view(np.uint8), want.materialize().view(np.uint8)), (slot, k)
    assert step == 1
    # experts and their moments split over dp on mesh B, never replicated (on 1 device: whole)
    _, r = restore(str(tmp_path / "orbax"), mesh_b)
    for tree in (r.params, r.opt_state[0].mu, r.opt_state[0].nu):
        assert tree["moe"]["experts"]["gate"]["kernel"].sharding.spec == spec(mesh_b, "pp", "dp", None, None)
    assert size(mesh_b) == 1 or "dp" in mesh_b
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "exported", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(back) is transformers.MixtralForCausalLM
    for key in ("num_local_experts", "num_experts_per_tok", "sliding_window", "rope_parameters"):
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(m))


# ------------------------------------------------------------------------------ configs


def test_configs_read_and_written():
    for name in MODELS:
        d = _hf_config(name).to_dict()
        cfg = models.config_from_hf(d)
        assert type(cfg) is MixtralConfig
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (d["num_local_experts"], d["num_experts_per_tok"])
    bare = {"architectures": ["MixtralForCausalLM"], **{k: v for k, v in SIZES.items()}}
    cfg = models.config_from_hf(bare)
    assert cfg.rope_theta == 1e6 and cfg.sliding_window is None  # MixtralConfig's defaults
    assert models.param_shape_tree(cfg)["moe"]["experts"]["down"]["kernel"] == (2, 4, 48, 32)
    assert models.logical_axes(cfg)["moe"]["experts"]["down"]["kernel"] == ("layers", "experts", "mlp", "embed")


def test_transformers_fused_layout_reads_as_the_per_expert_one(hf_dirs, tmp_path):
    """`save_pretrained(save_original_format=False)` writes transformers 5's fused
    `mlp.experts.gate_up_proj` [X, 2M, E]: read lazily under the per-expert names, each fused
    tensor's bytes once, the same bits and logits as the Hub layout."""
    folder, m = hf_dirs["mixtral"]
    m.save_pretrained(tmp_path, save_original_format=False)
    fused = open_source(str(tmp_path))
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused.tensors
    hub = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    with count_reads() as c:
        got = {k: v.materialize() for k, v in naming.source_to_hf(fused, fused.config).params.items()}
    path = str(tmp_path / "model.safetensors")
    assert c[path] == sum(t.nbytes for t in fused.tensors.values())
    assert sorted(got) == sorted(hub)
    for k, want in hub.items():
        assert np.array_equal(got[k], want), k
    np.testing.assert_allclose(jobs.logits(str(tmp_path), TOKENS, mesh=fit("dp=2,fsdp=2,tp=2", keep="dp")), _torch_logits(m), atol=ATOL, rtol=0)
