"""models/deepseek_v32 against transformers' own DeepseekV32ForCausalLM (5.24).

One tiny model built by transformers in this session, every parameter and the routers'
`e_score_correction_bias` buffers drawn at random, saved by its `save_pretrained` (fp32): 3 layers
(2 dense, 2 MoE), q LoRA, yarn RoPE with mscale (the softmax-scale correction), attention biases,
an indexer of 8 heads of 12 (8 rotated) keeping `index_topk` 4 keys of a 10-token sequence, so
the selection masks keys from the 5th query on. An MTP module is appended as DeepSeek's
checkpoints carry it (`model.layers.4.*`: a whole MoE layer with its indexer, `enorm`, `hnorm`,
`eh_proj`, `shared_head.*`, `embed_tokens`; transformers' model ignores it).
The same model loaded by transformers in bf16 and saved again keeps `indexer.weights_proj`,
the router weight and its bias fp32 (`_keep_in_fp32_modules`): that folder goes through import,
a restore onto another mesh and export bit for bit, dtypes included, and loads back in
transformers with identical logits.
Tolerance: fp32 logits vs transformers atol 1e-4.
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
from hf_parity import load_fp32, read_params
from meshes import abstract_mesh, fit, fit_pair
from safetensors.torch import load_file, save_file

from hybridckpt import jobs, models, naming, plan
from hybridckpt.formats.registry import open_source
from hybridckpt.models.deepseek_v3.module import apply_rope_interleaved
from hybridckpt.models.deepseek_v32 import indexer as indexer_mod
from hybridckpt.models.deepseek_v32.config import DeepseekV32Config
from hybridckpt.models.errors import ConfigError

TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4, 10, 20], [0, 11, 42, 17, 6, 5, 60, 3, 33, 2]], np.int32)
ATOL = 1e-4
MESH = "dp=1,fsdp=2,tp=2,pp=2"  # the mesh, fitted to the devices present
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8,
    n_group=4, topk_group=2, num_experts_per_tok=2, max_position_embeddings=64,
    num_hidden_layers=4, first_k_dense_replace=2, rope_parameters=YARN, attention_bias=True,
    index_topk=4, index_head_dim=12, index_n_heads=8,
)  # fmt: skip
MTP_ROOT = 4


def _build(seed: int = 0) -> transformers.DeepseekV32ForCausalLM:
    cfg = transformers.DeepseekV32Config(**SIZES, attn_implementation="eager")
    m = transformers.DeepseekV32ForCausalLM(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(
                1.0 if name.endswith(("norm.weight", "layernorm.weight")) else 0.0,
                0.15 if p.ndim > 1 else 0.3,
            )
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return m


def _mtp_tensors(saved: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """One MTP module at `model.layers.{MTP_ROOT}`: the last layer's keys (its indexer's too)
    with fresh values, and the module's own tensors."""
    g = torch.Generator().manual_seed(seed)
    last, root = f"model.layers.{MTP_ROOT - 1}.", f"model.layers.{MTP_ROOT}."
    out = {
        root + k[len(last) :]: torch.randn(v.shape, generator=g)
        for k, v in saved.items()
        if k.startswith(last)
    }
    E, V = SIZES["hidden_size"], SIZES["vocab_size"]
    own = {"embed_tokens.weight": (V, E), "enorm.weight": (E,), "hnorm.weight": (E,), "eh_proj.weight": (E, 2 * E),
           "shared_head.norm.weight": (E,), "shared_head.head.weight": (V, E)}  # fmt: skip
    out.update({root + k: torch.randn(shape, generator=g) for k, shape in own.items()})
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """(folder written by transformers plus the MTP module, its model, its logits)."""
    m = _build()
    folder = str(tmp_path_factory.mktemp("ds32"))
    m.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    saved = load_file(path)
    save_file({**saved, **_mtp_tensors(saved, 7)}, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:  # as DeepSeek's config.json says it
        json.dump({**config, "num_nextn_predict_layers": 1}, f)
    return folder, m, _torch_logits(m)


@pytest.fixture(scope="module")
def read(hf_dir):
    return read_params(hf_dir[0])


def _torch_logits(m) -> np.ndarray:
    with torch.no_grad():
        return m.float()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def _quick_forward(cfg, params) -> np.ndarray:
    """Our logits on one device, compiled at XLA's lowest optimisation level (the values checked
    against transformers' differ by 1e-6 or by far more than the tolerance)."""
    lowered = jax.jit(lambda p: models.forward(cfg, p, TOKENS)).lower(params)
    return np.asarray(
        lowered.compile(compiler_options={"xla_backend_optimization_level": 0})(params)
    )


def _selections(m, monkeypatch) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer of transformers' forward: the keys its indexer selects `[b, s, topk]` (sorted)
    and its index scores `[b, s, s]` (what its `topk` ranks)."""
    picks, scores = [], []
    topk = torch.Tensor.topk

    def recording(t, k, *args, **kw):
        if t.ndim == 3 and t.shape[-2:] == (TOKENS.shape[1],) * 2:
            scores.append(t.numpy().copy())
        return topk(t, k, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "topk", recording)
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda mod, a, out: picks.append(np.sort(out.numpy(), -1)))
             for layer in m.model.layers]  # fmt: skip
    _torch_logits(m)
    for h in hooks:
        h.remove()
    monkeypatch.undo()
    return picks, scores


# --------------------------------------------------------------------------- forward parity


def test_logits_equal_transformers_on_a_tp_pp_mesh(hf_dir):
    folder, _, want = hf_dir
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=fit(MESH)), want, atol=ATOL, rtol=0)


def test_the_selection_masks_keys_in_transformers(hf_dir, monkeypatch):
    """In transformers' own forward the indexer keeps 4 of up to 10 causal keys, not simply the
    latest or the first ones, and differently per layer; its index scores have no tie at the edge
    of the top 4 (equal scores there would leave the choice to torch's unspecified order of
    ties: `models.deepseek_v32.indexer`), so the parity above is a defined comparison."""
    picks, scores = _selections(hf_dir[1], monkeypatch)
    assert len(picks) == len(scores) == SIZES["num_hidden_layers"]
    for sel, sc in zip(picks, scores, strict=True):
        assert sel.shape == (2, 10, 4)
        late = sel[:, 4:]  # queries 4..9 see 5..10 causal keys, keep 4
        latest = np.arange(4, 10)[None, :, None] - np.arange(3, -1, -1)[None, None, :]
        assert (late != latest).any() and (late != np.arange(4)).any()
        ranked = -np.sort(-sc[:, 4:], axis=-1)
        assert (ranked[..., 3] > ranked[..., 4]).all()
    assert any((a[:, 4:] != b[:, 4:]).any() for a, b in zip(picks[:-1], picks[1:], strict=True))


# ------------------------------------------------------- each V3.2 part matters

# name -> (what it changes, how): the indexer's module functions, or the params
MODULE_DROPS = {
    "indexer_rope_half_split": (
        "apply_rope",
        apply_rope_interleaved,
    ),  # MLA's interleaved RoPE instead
    "indexer_relu": ("relu", lambda x: x),
}


def _param_drop(name: str, params: dict) -> dict:
    layers = {**params["layers"]}
    ix = {**layers["indexer"]}
    if name == "weights_proj":  # every index head weighted alike
        ix["weights_proj"] = {"kernel": np.full_like(ix["weights_proj"]["kernel"], 0.5)}
    elif name == "k_norm_affine":
        ix["k_norm"] = {
            "scale": np.ones_like(ix["k_norm"]["scale"]),
            "bias": np.zeros_like(ix["k_norm"]["bias"]),
        }
    layers["indexer"] = ix
    return {**params, "layers": layers}


@pytest.mark.parametrize("part", ["selection", *MODULE_DROPS, "weights_proj", "k_norm_affine"])
def test_each_v32_part_matters(hf_dir, read, monkeypatch, part):
    """Same params, one V3.2 part dropped: our logits leave transformers' far behind (with every
    part they equal them, `test_logits_equal_transformers_on_a_tp_pp_mesh` and below)."""
    want = hf_dir[2]
    cfg, params = read
    if part == "selection":  # every causal key attended: DeepSeek V3's attention
        cfg = dataclasses.replace(cfg, index_topk=10_000)
    elif part in MODULE_DROPS:
        monkeypatch.setattr(indexer_mod, *MODULE_DROPS[part])
    else:
        params = _param_drop(part, params)
    diff = np.abs(_quick_forward(cfg, params) - want).max()
    assert diff > 100 * ATOL, (part, diff)


# ------------------------------------------------------------------- import, export, reload


def test_bf16_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dir, tmp_path):
    """A bf16 checkpoint (transformers' bf16 save, its router kept fp32) whose
    `indexer.weights_proj` is stored fp32 (the fp32 values: transformers keeps that module fp32
    when it can, `_keep_in_fp32_modules`) and with the MTP module: import (tp and pp) -> restore
    (another mesh) -> export gives back every tensor, dtype and bits, and transformers' load of
    the export computes the same logits as its load of the source."""
    folder = hf_dir[0]
    kw = {"attn_implementation": "eager"}
    bf16 = str(tmp_path / "bf16")
    transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, **kw
    ).save_pretrained(bf16)
    path = os.path.join(bf16, "model.safetensors")
    fp32 = load_file(os.path.join(folder, "model.safetensors"))
    extra = {k: v if k.endswith("weights_proj.weight") else v.to(torch.bfloat16) for k, v in fp32.items()
             if k.startswith(f"model.layers.{MTP_ROOT}.") or k.endswith("weights_proj.weight")}  # fmt: skip
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(bf16, "config.json"), "w") as f:
        json.dump({**config, "dtype": "bfloat16"}, f)
    written = {k: str(v.dtype).removeprefix("torch.") for k, v in load_file(path).items()}
    assert written["model.layers.1.self_attn.indexer.weights_proj.weight"] == "float32"
    assert written["model.layers.2.mlp.gate.weight"] == "float32"
    assert written["model.layers.1.self_attn.indexer.wq_b.weight"] == "bfloat16"
    mesh_a, mesh_b = fit_pair(MESH, "dp=2,tp=4")
    params, *_ = roundtrip(bf16, tmp_path / "rt", mesh_a=mesh_a, mesh_b=mesh_b, optimizer=False)
    source = {k: v.materialize() for k, v in open_source(bf16).tensors.items()}
    assert (
        sorted(params) == sorted(source)
        and f"model.layers.{MTP_ROOT}.self_attn.indexer.wk.weight" in params
    )
    for k, want in source.items():
        assert params[k].dtype == want.dtype and params[k].dtype.name == written[k], k
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k
    back = load_fp32(str(tmp_path / "rt" / "exported"))
    assert type(back) is transformers.DeepseekV32ForCausalLM
    for key in ("index_topk", "index_head_dim", "index_n_heads", "q_lora_rank", "rope_parameters",
                "mlp_layer_types", "n_group", "attention_bias"):  # fmt: skip
        assert getattr(back.config, key) == getattr(hf_dir[1].config, key), key
    np.testing.assert_array_equal(_torch_logits(back), _torch_logits(load_fp32(bf16)))


# ------------------------------------------------------------------------------ configs


def _hf_config(**change) -> dict:
    return {**transformers.DeepseekV32Config(**SIZES).to_dict(), **change}


def test_config_read_written_and_the_tree(hf_dir, read):
    cfg = models.config_from_hf(_hf_config())
    assert type(cfg) is DeepseekV32Config and cfg.family == "deepseek_v32"
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads, cfg.num_dense_layers) == (
        4,
        12,
        8,
        2,
    )
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    assert models.config_from_hf(models.config_to_hf(cfg)) == cfg
    back = transformers.DeepseekV32Config(**models.config_to_hf(cfg)).to_dict()
    for key in set(_hf_config()) - {"transformers_version", "dtype", "architectures"}:
        assert back.get(key) == _hf_config()[key], key
    # mlp_layer_types, when given, says where the dense layers are (transformers follows it)
    assert (
        models.config_from_hf(
            _hf_config(mlp_layer_types=["dense"] * 3 + ["sparse"])
        ).num_dense_layers
        == 3
    )
    axes = models.logical_axes(read[0])
    assert axes["layers"]["indexer"]["wq_b"]["kernel"] == ("layers", None, "heads")
    assert axes["mtp"]["layers"]["indexer"]["wk"]["kernel"] == (None, "embed", None)
    saved = set(open_source(hf_dir[0]).tensors)
    assert set(naming.model_hf_shapes(read[0])) == saved


@pytest.mark.parametrize(
    "change, words",
    [
        ({"q_lora_rank": None}, "q_lora_rank is null"),
        ({"rope_interleave": False}, "rope_interleave False"),
        ({"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, "mlp_layer_types"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
        ({"index_head_dim": 6}, "index_head_dim 6 is below qk_rope_head_dim 8"),
        ({"index_topk": 0}, "index_topk"),
    ],
)
def test_config_refusals(change, words):
    with pytest.raises(ConfigError, match=f"c.json: .*{words}"):
        models.config_from_hf(_hf_config(**change), source="c.json")


def test_released_config_reads_as_transformers_does():
    """deepseek-ai/DeepSeek-V3.2-Exp's config.json (its quantization_config aside, which the HF
    reader takes off: `hybridckpt/formats/hf/quant.py`): 3 dense + 58 MoE layers and the MTP
    module `model.layers.61.*`, the indexer's sizes, and the softmax scale transformers computes."""
    from test_deepseek_v3 import HUB_V3

    hub = {**HUB_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
           "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}  # fmt: skip
    cfg = models.config_from_hf(hub)
    assert cfg.family == "deepseek_v32"
    assert (cfg.num_dense_layers, cfg.num_moe_layers, cfg.mtp_layers) == (3, 58, 1)
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads) == (2048, 128, 64)
    assert models.rule_variables(cfg)["mtp_layers"] == "61"
    theirs = transformers.DeepseekV32Config(**models.config_to_hf(cfg))
    scale = transformers.models.deepseek_v32.modeling_deepseek_v32.yarn_apply_mscale(
        theirs.rope_parameters, theirs.qk_head_dim**-0.5
    )
    assert cfg.softmax_scale == scale
    names = naming.model_hf_shapes(cfg)
    assert names["model.layers.61.self_attn.indexer.wq_b.weight"] == (64 * 128, 1536)
    assert names["model.layers.0.self_attn.indexer.weights_proj.weight"] == (64, 7168)


def test_index_heads_split_over_tp_on_head_boundaries():
    """On tp=4 (8 devices, the plan alone) `wq_b`'s 8 index heads of 12 split 2 per device and
    MLA's q_b heads too; `wk`, `k_norm` and `weights_proj` stay whole over tp; 6 index heads
    (72 values: divisible by 4, the heads not) are not split inside a head."""
    cfg = models.config_from_hf(_hf_config())
    p = plan.for_model(cfg, abstract_mesh("dp=2,tp=4"), indivisible="replicate").param_shardings[
        "layers"
    ]
    assert p["indexer"]["wq_b"]["kernel"].spec[2] == "tp"
    assert p["q_b"]["kernel"].spec[2] == "tp"
    for leaf in (
        p["indexer"]["wk"]["kernel"],
        p["indexer"]["weights_proj"]["kernel"],
        p["indexer"]["k_norm"]["scale"],
    ):
        assert "tp" not in jax.tree.leaves(tuple(leaf.spec)), leaf.spec
    odd = dataclasses.replace(cfg, index_n_heads=6)
    q = plan.for_model(odd, abstract_mesh("dp=2,tp=4"), indivisible="replicate").param_shardings[
        "layers"
    ]
    assert "tp" not in jax.tree.leaves(tuple(q["indexer"]["wq_b"]["kernel"].spec))
