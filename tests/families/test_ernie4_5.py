"""models/ernie4_5 and models/ernie4_5_moe against transformers' own Ernie4_5ForCausalLM and
Ernie4_5_MoeForCausalLM (5.24).

Tiny models built and saved by transformers' `save_pretrained` in this session, every parameter
random (`hf_parity.build`), the routers' `moe_statics.e_score_correction_bias` too (transformers
initialises it to 0, which would hide a dropped bias). Variants:
- `dense`: Ernie4_5ForCausalLM with `use_bias` (q/k/v/o and MLP biases), tied, explicit head_dim;
- `moe`: Ernie4_5_MoeForCausalLM with `use_bias` (the lm_head bias of a tied head included), one
  shared expert, dense layers 0-1 and MoE layers 2-3 (`moe_layer_start_index` 2), and one MTP
  module appended as the releases carry it (`model.mtp_block.0.*`, `model.mtp_*_norm.0`,
  `model.mtp_linear_proj.0`; transformers ignores them);
- `moe_interval`: untied, no biases, no shared expert, MoE on every second layer
  (`moe_layer_interval` 2: layers 1 and 3).
Logits: fp32 against transformers' fp32 forward, atol 1e-4, on a mesh with pp=2 and tp (fewer
devices: the largest of that form). Each ERNIE part removed moves the logits far. Import ->
restore -> export is bitwise, transformers loads the export back; transformers' in-memory names
(`mlp.gate.moe_statics.*`, fused experts: `save_original_format=False`) read as the stored ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest
from e2e import roundtrip
from hf_parity import (
    ATOL,
    TOKENS,
    assert_far,
    build,
    load_fp32,
    other_mesh,
    pp_tp_mesh,
    read_params,
    torch_logits,
)
from meshes import abstract_mesh

from hybridckpt import jobs, models, plan
from hybridckpt.formats.registry import open_source
from hybridckpt.models.ernie4_5.config import Ernie45Config
from hybridckpt.models.ernie4_5_moe.config import Ernie45MoeConfig
from hybridckpt.models.errors import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
MOE = dict(BASE, moe_intermediate_size=16, moe_num_experts=8, moe_k=2)
VARIANTS = {
    "dense": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(BASE, num_hidden_layers=2, head_dim=12, use_bias=True)),
    "moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
            dict(MOE, use_bias=True, moe_num_shared_experts=1, moe_layer_start_index=2)),
    "moe_interval": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
                     dict(MOE, tie_word_embeddings=False, moe_num_shared_experts=0, moe_layer_start_index=0,
                          moe_layer_interval=2, rope_parameters={"rope_type": "default", "rope_theta": 3000.0})),
}  # fmt: skip


def _build(name: str, seed: int):
    arch, cc, kwargs = VARIANTS[name]
    m = build(arch, cc, kwargs, seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if pname.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
    return m


def _add_mtp(folder: str, seed: int) -> None:
    """One MTP module as the releases carry it (`model.mtp_{emb,hidden}_norm.0`, `mtp_linear_proj.0`
    `[E, 2E]`, a dense decoder layer `model.mtp_block.0.*`: layer 0's keys with fresh values) and
    `num_nextn_predict_layers: 1` in config.json; transformers ignores both."""
    path = os.path.join(folder, "model.safetensors")
    saved = safetensors_torch.load_file(path)
    g = torch.Generator().manual_seed(seed)
    mtp = {"model.mtp_block.0." + k[len("model.layers.0."):]: torch.randn(v.shape, generator=g)
           for k, v in saved.items() if k.startswith("model.layers.0.")}  # fmt: skip
    E = BASE["hidden_size"]
    for k, shape in (("mtp_emb_norm.0.weight", (E,)), ("mtp_hidden_norm.0.weight", (E,)),
                     ("mtp_linear_proj.0.weight", (E, 2 * E))):  # fmt: skip
        mtp[f"model.{k}"] = torch.randn(shape, generator=g)
    safetensors_torch.save_file({**saved, **mtp}, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 1}, f)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for seed, name in enumerate(VARIANTS):
        m = _build(name, seed)
        folder = str(tmp_path_factory.mktemp(name))
        m.save_pretrained(folder)
        if name == "moe":
            _add_mtp(folder, seed + 10)
        out[name] = (folder, m)
    return out


@pytest.fixture(scope="module")
def read(hf_dirs):
    return {name: read_params(folder) for name, (folder, _) in hf_dirs.items()}


@functools.lru_cache(maxsize=16)
def _jitted(cfg):
    return jax.jit(lambda p: models.forward(cfg, p, TOKENS))


def _forward(cfg, params) -> np.ndarray:
    return np.asarray(_jitted(cfg)(params))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=pp_tp_mesh()), torch_logits(m), atol=ATOL, rtol=0)


def _no_biases(tree):
    return {k: _no_biases(v) for k, v in tree.items() if k != "bias"} if isinstance(tree, dict) else tree


def _without(part: str, cfg, params: dict):
    """(config, params) with one ERNIE-specific part removed."""
    if part == "interleaved_rope":  # Llama's half-split pairs instead
        return cfg, params, ("interleaved_rope", False)
    if part == "use_bias":
        cfg = dataclasses.replace(cfg, use_bias=False)
        keep = {"moe"} if "moe" in params else set()  # the router's correction bias is no Linear bias
        return cfg, {k: v if k in keep else _no_biases(v) for k, v in params.items()}, None
    moe = {**params["moe"]}
    if part == "correction_bias":
        moe["router"] = {**moe["router"], "bias": np.zeros_like(moe["router"]["bias"])}
    elif part == "shared_expert":
        moe["shared"] = jax.tree.map(np.zeros_like, moe["shared"])
    elif part == "lm_head_bias":
        params = {**params, "lm_head": {"bias": np.zeros_like(params["lm_head"]["bias"])}}
    elif part == "dense_layers":
        params = {**params, "mlp": jax.tree.map(np.zeros_like, params["mlp"])}
    return cfg, {**params, "moe": moe}, None


@pytest.mark.parametrize("name, part", [
    ("dense", "interleaved_rope"), ("dense", "use_bias"), ("moe", "interleaved_rope"), ("moe", "use_bias"),
    ("moe", "correction_bias"), ("moe", "shared_expert"), ("moe", "lm_head_bias"), ("moe", "dense_layers"),
    ("moe_interval", "dense_layers"),
])  # fmt: skip
def test_each_ernie_part_matters(hf_dirs, read, monkeypatch, name, part):
    """With every part our forward equals transformers'; with one removed it is far off."""
    want = torch_logits(hf_dirs[name][1])
    cfg, params = read[name]
    np.testing.assert_allclose(_forward(cfg, params), want, atol=ATOL, rtol=0)
    cfg, params, prop = _without(part, cfg, params)
    if prop:
        monkeypatch.setattr(Ernie45Config, prop[0], property(lambda self: prop[1]))
        got = np.asarray(jax.jit(lambda p: models.forward(cfg, p, TOKENS))(params))
    else:
        got = _forward(cfg, params)
    assert_far(got, want)


def test_mtp_is_carried_but_not_used(read):
    cfg, params = read["moe"]
    assert (cfg.mtp_layers, cfg.num_nextn_predict_layers) == (1, 1)
    assert params["mtp"]["linear_proj"]["kernel"].shape == (1, 64, 32)
    assert params["mtp"]["layers"]["gate"]["bias"].shape == (1, 48)
    noisy = {**params, "mtp": jax.tree.map(lambda a: a + 1.0, params["mtp"])}
    np.testing.assert_array_equal(_forward(cfg, noisy), _forward(cfg, params))
    assert read["moe_interval"][0].mtp_layers == 0 and "mtp" not in read["moe_interval"][1]
    with pytest.raises(ConfigError, match="MTP layer 0 \\(layer index 4\\) would be a mixture of experts"):
        dataclasses.replace(cfg, moe_layer_end_index=4)


def test_routing_bias_changes_the_choice(hf_dirs, read, monkeypatch):
    """The correction bias enters only the choice: switched off in the router (the weights are
    the plain probabilities either way), the logits move."""
    want = torch_logits(hf_dirs["moe_interval"][1])
    cfg, params = read["moe_interval"]
    monkeypatch.setattr(Ernie45MoeConfig, "routing_bias", property(lambda self: False))
    assert_far(np.asarray(jax.jit(lambda p: models.forward(cfg, p, TOKENS))(params)), want)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    params, *_ = roundtrip(folder, str(tmp_path), mesh_a=pp_tp_mesh(), mesh_b=other_mesh(), optimizer=False)
    source = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    assert sorted(params) == sorted(source)
    if name == "moe":
        assert "model.mtp_linear_proj.0.weight" in params and "model.mtp_block.0.mlp.down_proj.bias" in params
    for k, want in source.items():
        assert params[k].dtype == want.dtype and params[k].shape == want.shape, k
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k
    back = load_fp32(os.path.join(str(tmp_path), "exported"))
    assert type(back) is type(m)
    for key in ("use_bias", "tie_word_embeddings", "head_dim", "rope_parameters", "moe_layer_start_index",
                "moe_layer_end_index", "moe_layer_interval", "moe_num_shared_experts", "moe_norm_min"):
        assert getattr(back.config, key, None) == getattr(m.config, key, None), key
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_transformers_in_memory_names_read_as_the_stored_ones(hf_dirs, read, tmp_path):
    """`save_original_format=False` writes transformers' module names: fused experts and
    `mlp.gate.moe_statics.e_score_correction_bias`; the same params and logits, and the export
    writes the stored names."""
    folder, m = hf_dirs["moe"]
    fused = str(tmp_path / "fused")
    m.save_pretrained(fused, save_original_format=False)
    names = set(open_source(fused).tensors)
    assert "model.layers.2.mlp.gate.moe_statics.e_score_correction_bias" in names
    assert "model.layers.2.mlp.experts.gate_up_proj" in names
    without_mtp = {k: v for k, v in read["moe"][1].items() if k != "mtp"}  # transformers saves none
    jax.tree.map(np.testing.assert_array_equal, read_params(fused)[1], without_mtp)
    params, *_ = roundtrip(fused, str(tmp_path / "rt"), mesh_a=pp_tp_mesh(), mesh_b=other_mesh(), optimizer=False)
    assert sorted(params) == sorted(k for k in open_source(folder).tensors if "mtp" not in k)


def test_heads_over_tp_and_experts_over_their_axis():
    cfg = models.config_from_hf(transformers.Ernie4_5_MoeConfig(**VARIANTS["moe"][2]).to_dict())
    p = plan.for_model(cfg, abstract_mesh("dp=2,fsdp=2,tp=2"), indivisible="replicate").param_shardings
    assert p["layers"]["q"]["kernel"].spec[2] == "tp" and p["layers"]["q"]["bias"].spec[1] == "tp"
    assert p["moe"]["experts"]["gate"]["kernel"].spec[1] == "dp"
    assert models.param_shape_tree(cfg)["moe"]["router"]["bias"] == (2, 1, 8)
    assert models.param_groups_tree(cfg)["layers"]["k"]["kernel"][2] == ("kv_heads", 2)


def test_configs_read_and_written(hf_dirs):
    for name, (_, m) in hf_dirs.items():
        cfg = models.config_from_hf(m.config.to_dict())
        assert type(cfg) is (Ernie45Config if name == "dense" else Ernie45MoeConfig)
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    moe = models.config_from_hf(hf_dirs["moe"][1].config.to_dict())
    assert (moe.moe_layers, moe.dense_layers, moe.head_dim) == ((2, 3), (0, 1), 8)
    assert models.config_from_hf(hf_dirs["moe_interval"][1].config.to_dict()).moe_layers == (1, 3)
    # Ernie4_5Config's defaults for absent keys: head_dim 128, rope_theta 500000, tied
    d = {k: v for k, v in hf_dirs["dense"][1].config.to_dict().items()
         if k not in ("head_dim", "rope_parameters", "rope_theta", "tie_word_embeddings")}  # fmt: skip
    d["hidden_size"] = 256
    cfg = models.config_from_hf(d)
    assert (cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings) == (128, 500000.0, True)
    assert models.config_from_hf({**d, "head_dim": None}).head_dim == 64


@pytest.mark.parametrize("change, words", [
    ({"moe_k": 9}, "moe_k 9 exceeds moe_num_experts 8"),
    ({"moe_layer_start_index": 5}, "no layer is a mixture of experts"),
    ({"moe_num_experts": [8, 8]}, "moe_num_experts \\[8, 8\\] is a list"),
    ({"num_key_value_heads": 3}, "num_heads 4 is not a multiple"),
])  # fmt: skip
def test_config_refusals(hf_dirs, change, words):
    with pytest.raises(ConfigError, match=f"c.json: .*{words}"):
        models.config_from_hf({**hf_dirs["moe"][1].config.to_dict(), **change}, source="c.json")
