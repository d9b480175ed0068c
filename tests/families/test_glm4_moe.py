"""models/glm4_moe against transformers' own Glm4MoeForCausalLM (5.24).

Tiny models are built and saved by transformers' `save_pretrained` in this session, every
parameter drawn at random and the routers' `e_score_correction_bias` buffers too (transformers
initialises them to 0, which would hide a dropped bias). Two variants:
- `glm45`: as GLM-4.5: q/k norm, qkv biases, partial rotary 0.5, 2 dense + 2 MoE layers, and one
  MTP module appended as the releases carry it (`model.layers.4.*`: a whole MoE layer plus
  `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.*`), written with safetensors'
  `save_file` beside transformers' tensors (transformers drops MTP on load).
- `air`: as GLM-4.5-Air (no q/k norm) without biases, yarn RoPE over the rotary dims, 4 MoE
  layers (first_k_dense_replace 0), norm_topk_prob off, no MTP weights (what transformers saves).
Logits: fp32 against transformers' fp32 forward, atol 1e-4, on a mesh with pp=2 and tp (fewer
devices: the largest of that form). Each GLM part removed from our config or params moves the
logits far. Import -> restore -> export is bitwise, and transformers loads the export back; a
bf16 save keeps the router weight and bias in fp32, and both dtypes come back bitwise.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from e2e import roundtrip
from hf_parity import (
    ATOL,
    TOKENS,
    assert_far,
    load_fp32,
    other_mesh,
    pp_tp_mesh,
    read_params,
    torch_logits,
)
from meshes import abstract_mesh

from hybridckpt import jobs, models, naming, plan
from hybridckpt.formats.registry import open_source
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.glm4_moe.config import Glm4MoeConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.5, max_position_embeddings=64,
)  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 5000.0, "partial_rotary_factor": 0.5}  # fmt: skip
VARIANTS = {
    "glm45": dict(num_hidden_layers=4, first_k_dense_replace=2, use_qk_norm=True, attention_bias=True),
    "air": dict(num_hidden_layers=4, first_k_dense_replace=0, use_qk_norm=False, attention_bias=False,
                norm_topk_prob=False, rope_parameters=YARN),
}  # fmt: skip
MTP_ROOT = 4  # glm45's MTP module: model.layers.{num_hidden_layers}


def _build(name: str, seed: int):
    cfg = transformers.Glm4MoeConfig(**SIZES, **VARIANTS[name], attn_implementation="eager")
    m = transformers.Glm4MoeForCausalLM(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            p.normal_(1.0 if pname.endswith("norm.weight") else 0.0, 0.15 if p.ndim > 1 else 0.3)
        for bname, b in m.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return m


def _mtp_tensors(saved: dict, layers: int, seed: int) -> dict:
    """One MTP module at `model.layers.{layers}`: the last (MoE) layer's keys with fresh values
    and the module's own tensors, shaped as in the releases."""
    g = torch.Generator().manual_seed(seed)
    last, out = f"model.layers.{layers - 1}.", {}
    for k, v in saved.items():
        if k.startswith(last):
            out[f"model.layers.{layers}." + k[len(last):]] = torch.randn(v.shape, generator=g)
    E, V = SIZES["hidden_size"], SIZES["vocab_size"]
    own = {"embed_tokens.weight": (V, E), "enorm.weight": (E,), "hnorm.weight": (E,),
           "eh_proj.weight": (E, 2 * E), "shared_head.norm.weight": (E,), "shared_head.head.weight": (V, E)}
    for k, shape in own.items():
        out[f"model.layers.{layers}.{k}"] = torch.randn(shape, generator=g)
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers, its model)."""
    out = {}
    for seed, name in enumerate(VARIANTS):
        m = _build(name, seed)
        folder = str(tmp_path_factory.mktemp(name))
        m.save_pretrained(folder)
        if name == "glm45":
            path = os.path.join(folder, "model.safetensors")
            saved = safetensors_torch.load_file(path)
            safetensors_torch.save_file({**saved, **_mtp_tensors(saved, MTP_ROOT, 10)}, path, metadata={"format": "pt"})
        out[name] = (folder, m)
    return out


@pytest.fixture(scope="module")
def read(hf_dirs):
    return {name: read_params(folder) for name, (folder, _) in hf_dirs.items()}


@functools.lru_cache(maxsize=16)
def _jitted(cfg: Glm4MoeConfig):
    return jax.jit(lambda p: models.forward(cfg, p, TOKENS))


def _forward(cfg, params) -> np.ndarray:
    return np.asarray(_jitted(cfg)(params))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    got = jobs.logits(folder, TOKENS, mesh=pp_tp_mesh())
    np.testing.assert_allclose(got, torch_logits(m), atol=ATOL, rtol=0)


def _without(part: str, cfg, params: dict):
    """(config, params) with one GLM-specific part removed."""
    moe, layers = {**params["moe"]}, {**params["layers"]}
    if part == "qk_norm":
        cfg = dataclasses.replace(cfg, use_qk_norm=False)
    elif part == "partial_rotary":
        cfg = dataclasses.replace(cfg, partial_rotary_factor=1.0)
    elif part == "qkv_bias":
        cfg = dataclasses.replace(cfg, attention_bias=False)
        layers = {k: {"kernel": v["kernel"]} if k in ("q", "k", "v") else v for k, v in layers.items()}
    elif part == "correction_bias":
        moe["router"] = {**moe["router"], "bias": np.zeros_like(moe["router"]["bias"])}
    elif part == "shared_expert":
        moe["shared"] = jax.tree.map(np.zeros_like, moe["shared"])
    elif part == "group_limit":
        cfg = dataclasses.replace(cfg, n_group=1, topk_group=1)
    elif part == "routed_scaling_factor":
        cfg = dataclasses.replace(cfg, routed_scaling_factor=1.0)
    elif part == "first_dense_layers":  # the dense layer's MLP
        params = {**params, "mlp": jax.tree.map(np.zeros_like, params["mlp"])}
    return cfg, {**params, "moe": moe, "layers": layers}


@pytest.mark.parametrize("part", ["qk_norm", "partial_rotary", "qkv_bias", "correction_bias", "shared_expert",
                                  "group_limit", "routed_scaling_factor", "first_dense_layers"])
def test_each_glm_part_matters(hf_dirs, read, part):
    """With every part our forward equals transformers'; with one removed it is far off."""
    want = torch_logits(hf_dirs["glm45"][1])
    cfg, params = read["glm45"]
    np.testing.assert_allclose(_forward(cfg, params), want, atol=ATOL, rtol=0)
    assert_far(_forward(*_without(part, cfg, params)), want)


def test_mtp_is_carried_but_not_used(read):
    cfg, params = read["glm45"]
    assert (cfg.mtp_layers, cfg.num_nextn_predict_layers) == (1, 1)
    assert params["mtp"]["moe"]["experts"]["gate"]["kernel"].shape == (1, 8, 32, 16)
    noisy = {**params, "mtp": jax.tree.map(lambda a: a + 1.0, params["mtp"])}
    np.testing.assert_array_equal(_forward(cfg, noisy), _forward(cfg, params))
    air_cfg, air = read["air"]
    assert air_cfg.mtp_layers == 0 and "mtp" not in air


@pytest.mark.parametrize("name", list(VARIANTS))
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    params, *_ = roundtrip(folder, str(tmp_path), mesh_a=pp_tp_mesh(), mesh_b=other_mesh(), optimizer=False)
    source = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    assert sorted(params) == sorted(source)
    if name == "glm45":
        assert f"model.layers.{MTP_ROOT}.eh_proj.weight" in params
    for k, want in source.items():
        assert params[k].dtype == want.dtype and params[k].shape == want.shape, k
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k
    back = load_fp32(os.path.join(str(tmp_path), "exported"))
    assert type(back) is type(m)
    for key in ("rope_parameters", "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob",
                "routed_scaling_factor", "use_qk_norm", "attention_bias", "head_dim", "num_nextn_predict_layers"):
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_fused_expert_layout_reads_the_same(hf_dirs, read, tmp_path):
    """`save_pretrained(save_original_format=False)` writes transformers 5's fused experts
    (`mlp.experts.gate_up_proj`, `down_proj`): the same params as the per-expert file."""
    folder, m = hf_dirs["air"]
    fused = str(tmp_path / "fused")
    m.save_pretrained(fused, save_original_format=False)
    names = set(open_source(fused).tensors)
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    jax.tree.map(np.testing.assert_array_equal, read_params(fused)[1], read["air"][1])


def test_bf16_checkpoint_keeps_its_fp32_router(hf_dirs, tmp_path):
    """transformers loads GLM-4.5 in bf16 but keeps the router's weight and correction bias in
    fp32 (`_keep_in_fp32_modules_strict`) and saves them so, as the releases hold them: both
    dtypes come back bitwise, and our forward equals transformers' fp32 load of that folder."""
    folder, _ = hf_dirs["air"]
    bf16 = str(tmp_path / "bf16")
    transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(bf16)
    tensors = open_source(bf16).tensors
    assert tensors["model.layers.1.mlp.gate.weight"].dtype.name == "float32"
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype.name == "float32"
    assert tensors["model.layers.1.self_attn.o_proj.weight"].dtype.name == "bfloat16"
    np.testing.assert_allclose(jobs.logits(bf16, TOKENS, mesh=pp_tp_mesh()), torch_logits(load_fp32(bf16)),
                               atol=ATOL, rtol=0)  # fmt: skip
    params, *_ = roundtrip(bf16, str(tmp_path / "rt"), mesh_a=pp_tp_mesh(), mesh_b=other_mesh(), optimizer=False)
    for k, want in tensors.items():
        want = want.materialize()
        assert params[k].dtype == want.dtype and np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k


def test_heads_over_tp_and_experts_over_their_axis():
    """On dp=2,fsdp=2,tp=2 (the plan alone, no devices): q/k/v and their biases split over tp between
    heads, the experts over dp, the per-head q/k norm scales replicated."""
    cfg = models.config_from_hf(transformers.Glm4MoeConfig(**SIZES, **VARIANTS["glm45"]).to_dict())
    p = plan.for_model(cfg, abstract_mesh("dp=2,fsdp=2,tp=2"), indivisible="replicate").param_shardings
    assert p["layers"]["q"]["kernel"].spec[2] == "tp" and p["layers"]["q"]["bias"].spec[1] == "tp"
    assert p["layers"]["k"]["bias"].spec[1] == "tp"
    assert p["layers"]["q_norm"]["scale"].spec[1:] in ((), (None,))
    assert p["moe"]["experts"]["gate"]["kernel"].spec[1] == "dp"
    assert p["mtp"]["moe"]["experts"]["down"]["kernel"].spec[1] == "dp"
    groups = models.param_groups_tree(cfg)
    assert groups["layers"]["q"]["kernel"][2] == ("heads", 4)
    assert groups["layers"]["k"]["bias"][1] == ("kv_heads", 2)


def test_config_read_and_written(hf_dirs):
    for name, (_, m) in hf_dirs.items():
        cfg = models.config_from_hf(m.config.to_dict())
        assert type(cfg) is Glm4MoeConfig and cfg.family == "glm4_moe"
        assert cfg.rotary_dim == 8
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
        back = transformers.Glm4MoeConfig(**models.config_to_hf(cfg)).to_dict()
        for key in ("rope_parameters", "partial_rotary_factor", "use_qk_norm", "n_group", "head_dim"):
            assert back.get(key) == m.config.to_dict().get(key), (name, key)
    # the released GLM-4.5's v4 spelling: top-level rope_theta and partial_rotary_factor
    v4 = {**hf_dirs["glm45"][1].config.to_dict(), "rope_parameters": None, "rope_theta": 1e6,
          "partial_rotary_factor": 0.25, "rope_scaling": None}  # fmt: skip
    cfg = models.config_from_hf(v4)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim, cfg.rope_scaling) == (1e6, 0.25, 4, None)
    del v4["partial_rotary_factor"]
    assert models.config_from_hf(v4).partial_rotary_factor == 0.5  # Glm4MoeConfig's default
    names = set(naming.model_hf_shapes(models.config_from_hf(hf_dirs["glm45"][1].config.to_dict())))
    assert f"model.layers.{MTP_ROOT}.shared_head.head.weight" in names


@pytest.mark.parametrize("change, words", [
    ({"n_group": 3}, "n_routed_experts 8 must split into n_group 3"),
    ({"topk_group": 5}, "topk_group 5 exceeds n_group 4"),
    ({"num_key_value_heads": 3}, "num_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"partial_rotary_factor": 0.1, "rope_parameters": None}, "rotary dims"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])  # fmt: skip
def test_config_refusals(hf_dirs, change, words):
    with pytest.raises(ConfigError, match=f"c.json: .*{words}"):
        models.config_from_hf({**hf_dirs["glm45"][1].config.to_dict(), **change}, source="c.json")


# zai-org/GLM-4.5's config.json as released (transformers 4.54's spelling: top-level rope_theta and
# partial_rotary_factor, rope_scaling null)
HUB_GLM45 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 151552,
}  # fmt: skip


def test_released_config_reads_as_transformers_does():
    """GLM-4.5's own config.json: 3 dense + 89 MoE layers + 1 MTP module, RoPE over 64 of 128 dims
    with transformers' frequencies (built from the file and from our written-back config alike)."""
    from hybridckpt.models.rope import rope_frequencies

    cfg = models.config_from_hf(HUB_GLM45)
    assert (cfg.num_dense_layers, cfg.num_moe_layers, cfg.mtp_layers, cfg.rotary_dim) == (3, 89, 1, 64)
    assert models.rule_variables(cfg)["mtp_layers"] == "92"
    rope = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeRotaryEmbedding
    for d in (HUB_GLM45, models.config_to_hf(cfg)):
        emb = rope(transformers.Glm4MoeConfig(**d))
        inv_freq, factor = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                                            max_position_embeddings=cfg.max_position_embeddings)  # fmt: skip
        np.testing.assert_array_equal(inv_freq, emb.inv_freq.numpy())
        assert factor == emb.attention_scaling == 1.0
