"""models/deepseek_v3 against transformers' own DeepseekV3ForCausalLM (5.23).

Tiny models are built, trained 2 AdamW steps and saved by transformers in this session (fp32
safetensors; `save_pretrained` writes the Hub's per-expert keys `mlp.experts.E.*_proj.weight`,
not its in-memory fused `gate_up_proj`), every parameter drawn at random first and the routers'
`e_score_correction_bias` buffers too (transformers initialises them to 0, which would hide a
dropped bias). Two variants:
- `lora`: q_lora_rank, yarn RoPE with mscale / mscale_all_dim (the softmax-scale correction),
  attention_bias (q_a, kv_a and o biases), 2 dense + 2 MoE layers, and one MTP module appended as the Hub's checkpoints have it
  (`model.layers.4.*`: a whole MoE layer, `enorm`, `hnorm`, `eh_proj`, `shared_head.*`,
  `embed_tokens`; deepseek-ai/DeepSeek-V3:README_WEIGHTS.md), written with safetensors'
  `save_file` beside transformers' tensors, plus `optimizer.safetensors` (hybridckpt's unified
  HF layout, `hybridckpt.formats.hf`) holding torch's AdamW moments split per expert (AdamW is
  elementwise: the per-expert slice of a fused moment is that expert's moment), zeros for the
  correction-bias buffers (no optimizer state in torch) and drawn moments for the MTP module.
- `plain`: q_proj (q_lora_rank None), default RoPE, 1 dense + 2 MoE layers, norm_topk_prob off;
  no MTP weights although config.json says `num_nextn_predict_layers: 1` (what transformers
  saves), so the params tree has no `mtp`.
Routing is checked to matter in transformers itself: its routers choose different experts for
different tokens, and their choices differ from those without the correction bias or without the
group limit. Tolerances: fp32 logits vs transformers atol 1e-4 (observed ~3e-6 on logits of max
~4); the exported folder, loaded back by transformers, gives bit-identical logits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from e2e import roundtrip
from meshes import abstract_mesh, cases, fit, fit_pair
from safetensors.torch import load_file, save_file

from hybridckpt import jobs, models, naming, plan
from hybridckpt.formats.registry import open_source
from hybridckpt.models.deepseek_v3.config import DeepseekV3Config
from hybridckpt.models.rope import rope_frequencies

TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4, 10, 20], [0, 11, 42, 17, 6, 5, 60, 3, 33, 2]], np.int32)
ATOL = 1e-4
# experts split over dp on each (8 experts / dp=2); pp=2 and tp=4 as the issues ask
MESHES = ["dp=2,fsdp=2,tp=2", "dp=2,tp=2,pp=2", "dp=2,tp=4"]  # on 8 devices (fitted keeping dp)
SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4,
    topk_group=2, num_experts_per_tok=2, max_position_embeddings=64, routed_scaling_factor=2.5,
)  # fmt: skip
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VARIANTS = {
    "lora": dict(
        q_lora_rank=24,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        rope_parameters=YARN,
        attention_bias=True,
    ),
    "plain": dict(
        q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1, norm_topk_prob=False
    ),
}
MTP_ROOT = 4  # the lora variant's MTP module: model.layers.{num_hidden_layers}
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _build(name: str, seed: int) -> transformers.DeepseekV3ForCausalLM:
    cfg = transformers.DeepseekV3Config(**SIZES, **VARIANTS[name], attn_implementation="eager")
    m = transformers.DeepseekV3ForCausalLM(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            p.normal_(1.0 if pname.endswith("norm.weight") else 0.0, 0.15 if p.ndim > 1 else 0.3)
        for bname, b in m.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return m


def _train(m, steps: int = 2) -> torch.optim.AdamW:
    """`steps` AdamW steps of the causal-LM loss on a fixed batch (moments that are not 0)."""
    optim = torch.optim.AdamW(m.parameters(), **HYPER)
    batch = torch.tensor(TOKENS, dtype=torch.long)
    for _ in range(steps):
        optim.zero_grad()
        m(batch, labels=batch).loss.backward()
        optim.step()
    m.eval()
    return optim


def _mtp_tensors(saved: dict[str, torch.Tensor], layers: int, seed: int) -> dict[str, torch.Tensor]:
    """One MTP module at `model.layers.{layers}`: the last (MoE) layer's keys with fresh values,
    and the module's own tensors, shaped as in DeepSeek-V3's checkpoints."""
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{layers - 1}."
    out = {}
    for k, v in saved.items():
        if k.startswith(last):
            out[f"model.layers.{layers}." + k[len(last) :]] = torch.randn(v.shape, generator=g)
    E, V = SIZES["hidden_size"], SIZES["vocab_size"]
    own = {"embed_tokens.weight": (V, E), "enorm.weight": (E,), "hnorm.weight": (E,),
           "eh_proj.weight": (E, 2 * E), "shared_head.norm.weight": (E,),
           "shared_head.head.weight": (V, E)}  # fmt: skip
    for k, shape in own.items():
        out[f"model.layers.{layers}.{k}"] = torch.randn(shape, generator=g)
    return out


def _per_expert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A live transformers-5 tensor under the names save_pretrained writes (fused experts split:
    `gate_up_proj` [X, 2M, E] -> `E.gate_proj` [M, E], `E.up_proj`; `down_proj` [X, E, M])."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
        return {f"{base}{e}.{p}.weight": part.contiguous() for e in range(t.shape[0])
                for p, part in (("gate_proj", t[e, :half]), ("up_proj", t[e, half:]))}  # fmt: skip
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": t[e].contiguous() for e in range(t.shape[0])}
    return {name: t}


def _write_optimizer(folder: str, m, optim, extra: dict[str, torch.Tensor], seed: int) -> None:
    """`optimizer.safetensors` of the unified HF layout: `<hf name>.exp_avg|exp_avg_sq`, `step`."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    step = None
    for name, p in m.named_parameters():
        state = optim.state[p]
        step = int(state["step"])
        for slot in ("exp_avg", "exp_avg_sq"):
            for k, t in _per_expert(name, state[slot].detach()).items():
                out[f"{k}.{slot}"] = t.clone()
    for name, b in m.named_buffers():
        if name.endswith("e_score_correction_bias"):
            for slot in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{slot}"] = torch.zeros_like(b)
    for k, t in extra.items():
        out[f"{k}.exp_avg"] = torch.randn(t.shape, generator=g) * 1e-3
        out[f"{k}.exp_avg_sq"] = torch.rand(t.shape, generator=g) * 1e-6
    out["step"] = torch.tensor(float(step))
    save_file(out, os.path.join(folder, "optimizer.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers, its model)."""
    out = {}
    for seed, name in enumerate(VARIANTS):
        m = _build(name, seed)
        optim = _train(m)
        folder = str(tmp_path_factory.mktemp(name))
        m.save_pretrained(folder)
        if name == "lora":
            path = os.path.join(folder, "model.safetensors")
            saved = load_file(path)
            mtp = _mtp_tensors(saved, MTP_ROOT, seed + 10)
            save_file({**saved, **mtp}, path, metadata={"format": "pt"})
            _write_optimizer(folder, m, optim, mtp, seed + 20)
        out[name] = (folder, m)
    return out


@pytest.fixture(scope="module")
def read(hf_dirs):
    """name -> (config, params) read through the library from its folder (once)."""
    return {name: _params(folder) for name, (folder, _) in hf_dirs.items()}


def _torch_logits(m) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def _params(folder: str) -> tuple[DeepseekV3Config, dict]:
    """(config, params tree as numpy fp32) read through the library from an HF folder."""
    opened = jobs.open_checkpoint(folder)
    tree = naming.hf_to_tree(opened.named, opened.config).params
    flat = {k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()}
    return opened.config, naming.nest(flat)


@functools.lru_cache(maxsize=16)
def _jitted(cfg: DeepseekV3Config):
    """Our forward of `cfg` on one device, compiled once per config (cfg is read when traced)."""
    return jax.jit(lambda p: models.forward(cfg, p, TOKENS))


def _forward(cfg, params: dict) -> np.ndarray:
    return np.asarray(_jitted(cfg)(params))


# --------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("name, mesh", cases([(n, mesh) for n in VARIANTS for mesh in MESHES], keep="dp"))
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    np.testing.assert_allclose(
        jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=ATOL, rtol=0
    )


def test_fused_expert_layout_reads_the_same(hf_dirs, read, tmp_path):
    """`save_pretrained(save_original_format=False)` writes transformers 5's fused experts
    (`mlp.experts.gate_up_proj`, `down_proj`): the same logits, and the same params as the
    per-expert file (each expert a slice of the fused tensor)."""
    folder, m = hf_dirs["plain"]
    fused = str(tmp_path / "fused")
    m.save_pretrained(fused, save_original_format=False)
    names = set(open_source(fused).tensors)
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    np.testing.assert_allclose(
        jobs.logits(fused, TOKENS, mesh=fit(MESHES[1], keep="dp")), _torch_logits(m), atol=ATOL, rtol=0
    )
    a, b = _params(fused)[1], read["plain"][1]
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("mesh", MESHES)
def test_experts_are_split_over_dp(mesh):
    """On every test mesh each device holds a quarter or half of the experts, never all (the plan
    alone, on the 8-device meshes without devices: the same check on any device count)."""
    cfg = models.config_from_hf(_hf_config("lora"))
    p = plan.for_model(cfg, abstract_mesh(mesh), indivisible="replicate")
    for group in ("moe", ("mtp", "moe")):
        node = p.param_shardings
        for key in group if isinstance(group, tuple) else (group,):
            node = node[key]
        for leaf in ("gate", "up", "down"):
            spec = node["experts"][leaf]["kernel"].spec
            assert spec[1] == "dp", (group, leaf, spec)


def _router_choices(m) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per MoE layer of transformers' forward: (chosen experts, scores, correction bias)."""
    seen = []

    def hook(module, args, out):
        logits, _, idx = out
        bias = module.e_score_correction_bias.detach().numpy()
        seen.append((np.sort(idx.numpy(), -1), torch.sigmoid(logits).numpy(), bias))

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in m.model.layers
             if hasattr(layer.mlp, "gate")]  # fmt: skip
    _torch_logits(m)
    for h in hooks:
        h.remove()
    return seen


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    return np.sort(np.argsort(-x, axis=-1)[:, :k], -1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_routing_choices_vary_and_depend_on_bias_and_groups(hf_dirs, name):
    """In transformers' own forward: tokens go to different experts; without the correction
    bias, or without the group limit, some tokens would go elsewhere."""
    _, m = hf_dirs[name]
    k = m.config.num_experts_per_tok
    for chosen, scores, bias in _router_choices(m):
        assert len({tuple(c) for c in chosen}) > 2
        assert (_topk(scores, k) != chosen).any()  # the bias changes choices
        assert (_topk(scores + bias, k) != chosen).any()  # the group limit changes choices


# ------------------------------------------------------- each DeepSeek part matters


def _without(name: str, cfg, params: dict):
    """(config, params) with one DeepSeek-specific part removed or broken."""
    moe = {**params["moe"]}
    if name == "correction_bias":  # bias off the choice (it never enters the weights)
        moe["router"] = {**moe["router"], "bias": np.zeros_like(moe["router"]["bias"])}
    elif name == "shared_expert":
        moe["shared"] = jax.tree.map(np.zeros_like, moe["shared"])
    elif name == "expert_order":  # experts 0..7 -> 1..7, 0: the router's columns keep theirs
        moe["experts"] = jax.tree.map(lambda a: np.roll(a, 1, axis=1), moe["experts"])
    elif name == "group_limit":
        cfg = dataclasses.replace(cfg, n_group=1, topk_group=1)
    elif name == "routed_scaling_factor":
        cfg = dataclasses.replace(cfg, routed_scaling_factor=1.0)
    elif name == "rope_interleave":
        cfg = dataclasses.replace(cfg, rope_interleave=False)
    elif name == "yarn":
        cfg = dataclasses.replace(cfg, rope_scaling=None)
    elif name == "attention_bias":
        cfg = dataclasses.replace(cfg, attention_bias=False)
        layers = {k: {"kernel": v["kernel"]} if k in ("q_a", "kv_a", "o") else v
                  for k, v in params["layers"].items()}  # fmt: skip
        params = {**params, "layers": layers}
    return cfg, {**params, "moe": moe}


@pytest.mark.parametrize(
    "name, part",
    [("lora", p) for p in ("correction_bias", "shared_expert", "expert_order", "group_limit",
                           "routed_scaling_factor", "rope_interleave", "yarn", "mscale",
                           "attention_bias")]
    + [("plain", "expert_order"), ("plain", "group_limit")],
)  # fmt: skip
def test_each_deepseek_part_matters(hf_dirs, read, monkeypatch, name, part):
    """With every part our forward equals transformers'; with one removed it is far off."""
    want = _torch_logits(hf_dirs[name][1])
    cfg, params = read[name]
    np.testing.assert_allclose(_forward(cfg, params), want, atol=ATOL, rtol=0)
    if part == "mscale":  # the softmax scale without yarn's mscale**2 (cos/sin keep theirs)
        assert cfg.softmax_scale > 1.2 * cfg.qk_head_dim**-0.5
        monkeypatch.setattr(type(cfg), "softmax_scale", property(lambda c: c.qk_head_dim**-0.5))
        got = np.asarray(jax.jit(lambda p: models.forward(cfg, p, TOKENS))(params))
    else:
        got = _forward(*_without(part, cfg, params))
    assert np.abs(got - want).max() > 1000 * ATOL


def test_mtp_is_carried_but_not_used(read):
    """The MTP module's tensors are params (`mtp`), and changing them changes no logit."""
    cfg, params = read["lora"]
    assert cfg.mtp_layers == 1 and cfg.num_nextn_predict_layers == 1
    assert params["mtp"]["moe"]["experts"]["gate"]["kernel"].shape == (1, 8, 32, 16)
    noisy = {**params, "mtp": jax.tree.map(lambda a: a + 1.0, params["mtp"])}
    np.testing.assert_array_equal(_forward(cfg, noisy), _forward(cfg, params))
    plain_cfg, plain = read["plain"]
    assert plain_cfg.mtp_layers == 0 and plain_cfg.num_nextn_predict_layers == 1
    assert "mtp" not in plain


# ------------------------------------------------------------------- import, export, reload


@pytest.mark.parametrize(
    "name, mesh_a, mesh_b",
    cases([("lora", "dp=2,fsdp=2,tp=2", "dp=2,tp=2,pp=2"), ("plain", "dp=2,tp=4", "dp=1")], keep="dp"),
)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(
    hf_dirs, tmp_path, name, mesh_a, mesh_b
):
    folder, m = hf_dirs[name]
    moments = name == "lora"
    params, mu, nu, step = roundtrip(
        folder, tmp_path, mesh_a=mesh_a, mesh_b=mesh_b, optimizer=moments
    )
    src = open_source(folder)
    source = {k: v.materialize() for k, v in src.tensors.items()}
    assert sorted(params) == sorted(source)
    if moments:
        assert any(k.startswith(f"model.layers.{MTP_ROOT}.mlp.experts.7.") for k in params)
        assert step == 2
        for slot, got in (("exp_avg", mu), ("exp_avg_sq", nu)):
            want = {k: v.materialize() for k, v in src.optimizer.slots[slot].items()}
            assert sorted(got) == sorted(want)
            for k, w in want.items():
                assert np.array_equal(got[k].view(np.uint8), w.view(np.uint8)), (slot, k)
    for k, want in source.items():
        assert params[k].dtype == want.dtype and params[k].shape == want.shape, k
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k
    out = os.path.join(tmp_path, "exported")
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    back = transformers.AutoModelForCausalLM.from_pretrained(out, **kw).eval()
    assert type(back) is type(m)
    for key in ("q_lora_rank", "rope_parameters", "first_k_dense_replace", "n_group",
                "topk_group", "norm_topk_prob", "routed_scaling_factor", "num_nextn_predict_layers",
                "rope_interleave", "kv_lora_rank", "v_head_dim"):  # fmt: skip
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(m))


def test_bf16_checkpoint_with_its_fp32_correction_bias(hf_dirs, tmp_path):
    """transformers loads a DeepSeek V3 in bf16 but keeps `e_score_correction_bias` fp32
    (`_keep_in_fp32_modules_strict`) and saves it so: both dtypes come back bitwise, and our
    fp32 forward equals transformers' fp32 load of that folder."""
    folder, _ = hf_dirs["plain"]
    kw = {"attn_implementation": "eager"}
    bf16 = str(tmp_path / "bf16")
    transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, **kw
    ).save_pretrained(bf16)
    tensors = open_source(bf16).tensors
    # what this transformers wrote (5.23 saved the router's weight in bf16, 5.24 keeps it fp32
    # too): read from the file itself, then ours must say the same for every tensor
    written = {k: str(v.dtype).removeprefix("torch.") for k, v in load_file(os.path.join(bf16, "model.safetensors")).items()}
    assert written["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert written["model.layers.1.self_attn.o_proj.weight"] == "bfloat16"
    assert {k: t.dtype.name for k, t in tensors.items()} == written
    ref = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32, **kw).eval()
    np.testing.assert_allclose(
        jobs.logits(bf16, TOKENS, mesh=fit(MESHES[1], keep="dp")), _torch_logits(ref), atol=ATOL, rtol=0
    )
    params, *_ = roundtrip(
        bf16, tmp_path / "rt", **dict(zip(("mesh_a", "mesh_b"), fit_pair(MESHES[2], MESHES[0], keep="dp"), strict=True)),
        optimizer=False,
    )
    for k, want in tensors.items():
        want = want.materialize()
        assert params[k].dtype == want.dtype, k
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k


# ------------------------------------------------------------------------------ configs


def _hf_config(name: str) -> dict:
    return transformers.DeepseekV3Config(**SIZES, **VARIANTS[name]).to_dict()


def test_configs_read_and_written():
    for name in VARIANTS:
        cfg = models.config_from_hf(_hf_config(name))
        assert type(cfg) is DeepseekV3Config and cfg.family == "deepseek_v3"
        assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
        assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
        back = transformers.DeepseekV3Config(**models.config_to_hf(cfg)).to_dict()
        for key in set(_hf_config(name)) - {"transformers_version", "dtype", "architectures"}:
            assert back.get(key) == _hf_config(name)[key], (name, key)
    lora = models.config_from_hf(_hf_config("lora"))
    assert (lora.q_lora_rank, lora.num_dense_layers, lora.num_moe_layers) == (24, 2, 2)
    mscale = 0.1 * 1.0 * np.log(4.0) + 1.0
    assert lora.softmax_scale == 16**-0.5 * mscale * mscale
    assert models.config_from_hf(_hf_config("plain")).q_lora_rank is None
    variables = models.rule_variables(lora)
    assert (variables["dense_layers"], variables["moe_layers"], variables["mtp_layers"]) == (
        "0,1",
        "2,3",
        "4",
    )
    d = _hf_config("lora")
    del d["q_lora_rank"]  # absent: transformers' default 1536, unlike null
    assert models.config_from_hf(d).q_lora_rank == 1536
    tied = models.config_from_hf({**_hf_config("plain"), "tie_word_embeddings": True})
    assert "lm_head" not in models.param_shape_tree(tied)
    names = naming.model_hf_shapes(tied)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


# deepseek-ai/DeepSeek-V3's config.json as released (quantization_config and auto_map aside):
# the keys transformers ignores carry the values it assumes
HUB_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}  # fmt: skip


def test_released_config_reads_as_transformers_does():
    """DeepSeek-V3's own config.json: our softmax scale and RoPE are transformers' (built from
    the file and from our written-back config alike), and the layer groups are 3 + 58 + 1 MTP."""
    cfg = models.config_from_hf(HUB_V3)
    assert (cfg.num_dense_layers, cfg.num_moe_layers, cfg.mtp_layers) == (3, 58, 1)
    variables = models.rule_variables(cfg)
    assert variables["moe_layers"].startswith("3,4,") and variables["mtp_layers"] == "61"
    for d in (HUB_V3, models.config_to_hf(cfg)):
        theirs = transformers.DeepseekV3Config(**d)
        scaling = transformers.models.deepseek_v3.modeling_deepseek_v3.yarn_apply_mscale(
            theirs.rope_parameters, theirs.qk_head_dim**-0.5
        )
        assert cfg.softmax_scale == scaling
        rope = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding
        inv_freq, factor = rope_frequencies(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )  # fmt: skip
        emb = rope(theirs)
        np.testing.assert_array_equal(inv_freq, emb.inv_freq.numpy())
        assert factor == emb.attention_scaling == 1.0  # mscale == mscale_all_dim


@pytest.mark.parametrize(
    "change, words",
    [
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"topk_method": "greedy"}, "topk_method 'greedy'"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 differs"),
        ({"n_group": 3}, "n_routed_experts 8 must split into n_group 3"),
        ({"topk_group": 5}, "topk_group 5 exceeds n_group 4"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds the 4 experts"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized weights \\(fp8"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_config_refusals(change, words):
    with pytest.raises(models.errors.ConfigError, match=f"c.json: .*{words}"):
        models.config_from_hf({**_hf_config("lora"), **change}, source="c.json")


# ---------------------------------------------------------------------------- param trees


def test_param_tree_shapes_axes_and_hf_names(hf_dirs, read):
    cfg, _ = read["lora"]
    shapes = models.param_shape_tree(cfg)
    axes = models.logical_axes(cfg)
    assert axes["layers"]["q_a"]["kernel"] == ("layers", "embed", None)
    assert axes["layers"]["kv_a"]["kernel"] == ("layers", "embed", None)
    assert axes["layers"]["kv_b"]["kernel"] == ("layers", None, "heads")
    assert axes["moe"]["experts"]["down"]["kernel"] == ("layers", "experts", "mlp", "embed")
    assert axes["moe"]["router"] == {"kernel": ("layers", "embed", None), "bias": ("layers", None)}
    assert axes["mtp"]["moe"]["experts"]["gate"]["kernel"] == (None, "experts", "embed", "mlp")
    assert axes["mtp"]["eh_proj"]["kernel"] == (None, None, "embed")
    assert shapes["moe"]["experts"]["gate"]["kernel"] == (2, 8, 32, 16)
    assert shapes["mlp"]["gate"]["kernel"] == (2, 32, 48)
    # the names transformers writes (and the MTP module's) are exactly the ones export produces
    saved = set(open_source(hf_dirs["lora"][0]).tensors)
    assert set(naming.model_hf_shapes(cfg)) == saved
    assert json.dumps(models.config_to_hf(cfg))
