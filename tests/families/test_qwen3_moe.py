"""models/qwen3_moe against transformers' own Qwen3MoeForCausalLM, with experts split over devices.

Tiny models are built and saved by transformers in this session (fp32 safetensors, the Hub's
per-expert names `mlp.experts.E.gate_proj.weight`), every parameter drawn at random, routers
with a wide spread so the top-k choice differs across tokens (asserted from transformers' own
router logits). "qwen3_moe" is the released layout (every layer MoE, norm_topk_prob false);
"qwen3_moe_mixed" has dense layers 0 and 2 (`mlp_only_layers`) between MoE layers 1 and 3, so
the MoE and dense groups are stacked by index lists, plus norm_topk_prob and a sliding window.
Tolerances: fp32 logits vs transformers atol 1e-4; the export loads back bit-identical.
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
from fixtures.hf_moe import hf_state, randomize, write_adamw_moments
from meshes import cases, fit, fit_pair, size, spec

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source
from hybridckpt.jobs.restore import restore
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen3_moe.config import Qwen3MoeConfig

TOKENS = np.random.default_rng(2).integers(0, 96, (2, 12), dtype=np.int32)
ATOL = 1e-4
MESHES = ["dp=2,fsdp=2,tp=2", "dp=4,pp=2", "dp=1", "tp=4,pp=2"]
SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)  # fmt: skip
MODELS = {
    "qwen3_moe": {},
    "qwen3_moe_mixed": {
        "num_hidden_layers": 4, "mlp_only_layers": [0, 2], "norm_topk_prob": True,
        "num_experts": 8, "num_experts_per_tok": 3, "use_sliding_window": True, "sliding_window": 5,
    },  # fmt: skip
}


def _hf_config(name: str) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(**{**SIZES, **MODELS[name]}, attn_implementation="eager")


def _torch_logits(m: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers, its model)."""
    out = {}
    for seed, name in enumerate(MODELS):
        m = randomize(transformers.Qwen3MoeForCausalLM(_hf_config(name)), seed + 10)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        out[name] = (str(folder), m)
    return out


def _tree_params(folder):
    opened = jobs.open_checkpoint(folder)
    tree = naming.hf_to_tree(opened.named, opened.config).params
    return opened.config, naming.nest({k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()})


# --------------------------------------------------------------------------- forward parity


def test_saved_names_are_the_hubs_and_dense_layers_stack_apart(hf_dirs):
    folder, m = hf_dirs["qwen3_moe_mixed"]
    src = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    want = hf_state("qwen3_moe", m)
    assert sorted(src) == sorted(want)  # save_pretrained wrote the per-expert names
    assert "model.layers.2.mlp.gate_proj.weight" in src and "model.layers.3.mlp.experts.7.up_proj.weight" in src
    cfg, params = _tree_params(folder)
    assert (cfg.moe_layers, cfg.dense_layers) == ((1, 3), (0, 2))
    np.testing.assert_array_equal(  # MoE layer 3 is position 1 of the moe group
        params["moe"]["experts"]["up"]["kernel"][1, 7], src["model.layers.3.mlp.experts.7.up_proj.weight"].T
    )
    np.testing.assert_array_equal(params["mlp"]["down"]["kernel"][1], src["model.layers.2.mlp.down_proj.weight"].T)


@pytest.mark.parametrize("name", list(MODELS))
def test_top_k_choices_differ_across_tokens(hf_dirs, name):
    _, m = hf_dirs[name]
    with torch.no_grad():
        out = m(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True)
    k = m.config.num_experts_per_tok
    assert len(out.router_logits) == len(models.config_from_hf(m.config.to_dict()).moe_layers)
    for layer in out.router_logits:
        chosen = {tuple(sorted(r)) for r in torch.topk(layer, k, dim=-1).indices.tolist()}
        assert len(chosen) >= 3, chosen  # not one choice for every token


@pytest.mark.parametrize("name, mesh", cases([("qwen3_moe", m) for m in MESHES] + [("qwen3_moe_mixed", m) for m in MESHES[:2]], keep="dp"))
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_expert_order_norm_topk_prob_and_qk_norm_matter(hf_dirs, name):
    """Experts permuted (router unchanged), norm_topk_prob flipped or the q/k norms set to 1:
    logits far beyond tolerance."""
    folder, m = hf_dirs[name]
    want = _torch_logits(m)
    cfg, params = _tree_params(folder)
    forward = jax.jit(models.forward, static_argnums=0)
    np.testing.assert_allclose(np.asarray(forward(cfg, params, TOKENS)), want, atol=ATOL, rtol=0)
    perm = np.roll(np.arange(cfg.num_experts), 1)
    experts = {k: {"kernel": v["kernel"][:, perm]} for k, v in params["moe"]["experts"].items()}
    permuted = params | {"moe": params["moe"] | {"experts": experts}}
    assert np.abs(np.asarray(forward(cfg, permuted, TOKENS)) - want).max() > 1000 * ATOL
    flipped = dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob)
    # top-3 of 8 keep most of the mass, so renormalising moves logits less (observed 0.04)
    assert np.abs(np.asarray(forward(flipped, params, TOKENS)) - want).max() > 100 * ATOL
    layers = params["layers"] | {"q_norm": {"scale": np.ones_like(params["layers"]["q_norm"]["scale"])}}
    assert np.abs(np.asarray(forward(cfg, params | {"layers": layers}, TOKENS)) - want).max() > 1000 * ATOL


# ------------------------------------------------------------------- import, export, reload


def test_import_restore_export_with_adamw_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path):
    folder, m = hf_dirs["qwen3_moe_mixed"]
    work = tmp_path / "src"
    work.mkdir()
    for f in os.listdir(folder):
        os.symlink(os.path.join(folder, f), work / f)
    trained = transformers.Qwen3MoeForCausalLM(_hf_config("qwen3_moe_mixed"))
    trained.load_state_dict(m.state_dict())
    write_adamw_moments("qwen3_moe", trained, TOKENS, str(work))
    mesh_b, mesh_a = fit_pair("dp=2,fsdp=2,tp=2", "dp=4,pp=2", keep="dp")  # mesh B keeps dp first
    params, mu, nu, step = roundtrip(str(work), tmp_path, mesh_a=mesh_a, mesh_b=mesh_b)
    src = open_source(str(work))
    for k, want in src.tensors.items():
        assert np.array_equal(params[k].view(np.uint8), want.materialize().view(np.uint8)), k
    for slot, got in (("exp_avg", mu), ("exp_avg_sq", nu)):
        assert sorted(got) == sorted(src.optimizer.slots[slot])
        for k, want in src.optimizer.slots[slot].items():
            assert np.array_equal(got[k].view(np.uint8), want.materialize().view(np.uint8)), (slot, k)
    assert step == 1
    _, r = restore(str(tmp_path / "orbax"), mesh_b)
    for tree in (r.params, r.opt_state[0].mu, r.opt_state[0].nu):
        assert tree["moe"]["experts"]["down"]["kernel"].sharding.spec == spec(mesh_b, None, "dp", "tp", "fsdp")
        assert tree["mlp"]["gate"]["kernel"].sharding.spec == spec(mesh_b, None, "fsdp", "tp")
    assert size(mesh_b) == 1 or "dp" in mesh_b
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "exported", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(back) is transformers.Qwen3MoeForCausalLM
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "mlp_only_layers", "decoder_sparse_step", "sliding_window", "head_dim", "rope_parameters"):  # fmt: skip
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(m))


# ------------------------------------------------------------------------------ configs


def test_configs_read_and_written():
    for name in MODELS:
        d = _hf_config(name).to_dict()
        cfg = models.config_from_hf(d)
        assert type(cfg) is Qwen3MoeConfig
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    sparse_step = models.config_from_hf(_hf_config("qwen3_moe").to_dict() | {"num_hidden_layers": 4, "decoder_sparse_step": 2})
    assert sparse_step.moe_layers == (1, 3) and sparse_step.dense_layers == (0, 2)
    with pytest.raises(ConfigError, match="no layer is a mixture of experts"):
        models.config_from_hf(_hf_config("qwen3_moe").to_dict() | {"mlp_only_layers": [0, 1]})
    with pytest.raises(ConfigError, match="attention_bias=true"):
        models.config_from_hf(_hf_config("qwen3_moe").to_dict() | {"attention_bias": True})


def test_transformers_fused_layout_reads_as_the_per_expert_one(hf_dirs, tmp_path):
    """`save_pretrained(save_original_format=False)` (fused `mlp.experts.gate_up_proj`): the
    same tensors under the per-expert names, the same logits."""
    folder, m = hf_dirs["qwen3_moe_mixed"]
    m.save_pretrained(tmp_path, save_original_format=False)
    fused = open_source(str(tmp_path))
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused.tensors
    hub = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    got = {k: v.materialize() for k, v in naming.source_to_hf(fused, fused.config).params.items()}
    assert sorted(got) == sorted(hub)
    for k, want in hub.items():
        assert np.array_equal(got[k], want), k
    np.testing.assert_allclose(jobs.logits(str(tmp_path), TOKENS, mesh=fit("dp=4,pp=2", keep="dp")), _torch_logits(m), atol=ATOL, rtol=0)
