"""Qwen3-Next as Megatron-Core / Megatron-Bridge save it (torch_dist), read through its megatron
dialect (models/qwen3_next/dialects/megatron.*).

THE MEGATRON-SIDE FIXTURE IS AN IMITATION, NOT A SAVE BY THE TOOL. megatron-core 0.19.2 cannot
build Qwen3-Next on a CPU machine: the layer spec Megatron-Bridge uses
(`get_transformer_block_with_experimental_attention_variant_spec`) asserts
`transformer_impl == "transformer_engine"` (Transformer Engine builds only against CUDA), and
`GatedDeltaNet.__init__` (megatron/core/ssm/gated_delta_net/common.py) raises ImportError
without flash-linear-attention (Triton). So `fixtures/megatron_qwen3_next.py` writes the torch_dist
files (with torch's own DCP writer, ranks played in turn) from the key names and layouts
Megatron-Bridge@067f987's source and megatron-core 0.19.2's documents: qwen3_next_bridge.py
`provider_bridge` / `mapping_registry` (lines 60-247), param_mapping.py `merge_qkv_weights`
(line 3143, the gated q rows), `merge_gdn_linear_weights` (line 3502), `RMSNorm2ZeroCentered
RMSNormMapping` (line 2839), megatron-core gated_delta_net/common.py `sharded_state_dict` (lines
474-549: the `in_proj.weight.{query,key,value,z,beta,alpha}` and `conv1d.weight.{query,key,value}`
keys) and gdn.py line 40 (the section names). What is checked here is that the reader follows
those sources, not that a real save matches them.

The HF side: `hf524_qwen3_next` (written by transformers 5.24, 3 delta-net layers and one gated
attention layer, one key head, one kv group), and random tensors under the same names for a
config with two key heads and two kv groups, so the per-key-head grouping and tp = 2 sections
are exercised.
Checked: the config the run_config gives equals the HF one; after import onto a tp/pp mesh and
export, every param bit for bit equal to the HF tensors; logits equal transformers' recorded ones.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch
from cases import ckpt, reference
from fixtures.megatron_qwen3_next import provider, write_bridge_qwen3_next
from roundtrip_real import bitwise_equal
from safetensors.torch import load_file

from hybridckpt import jobs
from hybridckpt.errors import FormatError
from hybridckpt.formats.registry import open_source

CASE = "hf524_qwen3_next"
ATOL = 1e-4


def _mesh() -> str:
    n = jax.device_count()
    return (
        "dp=1,fsdp=2,tp=2,pp=2"
        if n >= 8
        else "tp=2,pp=2"
        if n >= 4
        else "pp=2"
        if n >= 2
        else "dp=1"
    )


def _hf_case() -> tuple[dict, dict]:
    with open(ckpt(CASE, "config.json")) as f:
        cfg = json.load(f)
    return load_file(ckpt(CASE, "model.safetensors")), cfg


@pytest.fixture(scope="module")
def imitation(tmp_path_factory) -> str:
    """The HF case as Bridge would save it (one key head, one kv group: tp 1; pp 2)."""
    hf, cfg = _hf_case()
    root = str(tmp_path_factory.mktemp("megatron_qwen3_next"))
    write_bridge_qwen3_next(root, hf, cfg, tp=1, pp=2, padded_vocab=128)
    return root


def test_config_and_names(imitation):
    src = open_source(imitation)
    want = jobs.open_checkpoint(ckpt(CASE)).config
    assert src.config == want
    assert "model config from run_config.yaml" in src.notes
    assert "decoder.layers.0.self_attention.in_proj.weight.beta" in src.tensors
    assert src.tensors["decoder.layers.1.self_attention.conv1d.weight.value"].shape == (8, 1, 4)


def _export(src: str, tmp, mesh: str) -> dict[str, np.ndarray]:
    store = os.path.join(tmp, "orbax")
    jobs.import_checkpoint(src, store, mesh=mesh)
    return _exported(store, tmp)


def _exported(store: str, tmp) -> dict[str, np.ndarray]:
    out = os.path.join(tmp, "exported")
    jobs.export_checkpoint(store, out, optimizer=False)
    return {k: v.materialize() for k, v in open_source(out).tensors.items()}


@pytest.fixture(scope="module")
def imported(imitation, tmp_path_factory) -> str:
    """The imitation imported onto a tp/pp mesh (our store)."""
    store = str(tmp_path_factory.mktemp("store") / "orbax")
    jobs.import_checkpoint(imitation, store, mesh=_mesh())
    return store


def test_params_bitwise_against_transformers(imported, tmp_path):
    """Imported onto a tp/pp mesh, exported as HF: every tensor of transformers' own save, bit for
    bit (the gated norm's minus 1 undone exactly, the vocabulary padding trimmed)."""
    got = _exported(imported, str(tmp_path))
    want = {k: v.materialize() for k, v in open_source(ckpt(CASE)).tensors.items()}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(got[k], v), k


def test_logits_equal_transformers(imported):
    """The imported model's forward on the tp/pp mesh against transformers' recorded one."""
    ref = reference(CASE)
    got = jobs.logits(imported, ref["tokens"], mesh=_mesh())
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=ATOL)


HYBRID = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=6,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=8,
    shared_expert_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=64, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip


def _hf_tensors(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the names and shapes transformers 5.24 saves for `c` (the ones
    `hf524_qwen3_next` holds, test above), the plain gated norm near 1 as trained ones are."""
    g = torch.Generator().manual_seed(seed)
    hid, hd, heads, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hid), "lm_head.weight": (c["vocab_size"], hid),
              "model.norm.weight": (hid,)}  # fmt: skip
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hid,), p + "post_attention_layernorm.weight": (hid,)}
        if kind == "full_attention":
            a = p + "self_attn."
            shapes |= {a + "q_proj.weight": (2 * heads * hd, hid), a + "k_proj.weight": (kv * hd, hid),
                       a + "v_proj.weight": (kv * hd, hid), a + "o_proj.weight": (hid, heads * hd),
                       a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}  # fmt: skip
        else:
            a = p + "linear_attn."
            shapes |= {a + "in_proj_qkvz.weight": (2 * kd + 2 * vd, hid), a + "in_proj_ba.weight": (2 * nv, hid),
                       a + "conv1d.weight": (2 * kd + vd, 1, c["linear_conv_kernel_dim"]), a + "A_log": (nv,),
                       a + "dt_bias": (nv,), a + "norm.weight": (c["linear_value_head_dim"],),
                       a + "out_proj.weight": (hid, vd)}  # fmt: skip
        e, m, s = p + "mlp.", c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        shapes |= {e + "gate.weight": (c["num_experts"], hid), e + "shared_expert_gate.weight": (1, hid),
                   e + "shared_expert.gate_proj.weight": (s, hid), e + "shared_expert.up_proj.weight": (s, hid),
                   e + "shared_expert.down_proj.weight": (hid, s)}  # fmt: skip
        for j in range(c["num_experts"]):
            x = e + f"experts.{j}."
            shapes |= {x + "gate_proj.weight": (m, hid), x + "up_proj.weight": (m, hid), x + "down_proj.weight": (hid, m)}
    out = {k: torch.randn(v, generator=g) * 0.3 for k, v in shapes.items()}
    for k in out:
        if k.endswith("linear_attn.norm.weight"):
            out[k] = 1.0 + out[k] / 3
    return out


def test_two_key_heads_at_tp2_regroup_as_hf(tmp_path):
    """Two key heads (two value heads each) and two kv groups, saved at tp = 2, pp = 2 (each
    section key in two row chunks): the per-key-head regrouping and the gated q rows give the HF
    tensors under their names, bit for bit (fp32; the gated norm's w - 1 and + 1 are exact for w
    in [0.5, 2], Sterbenz; Megatron's own fp32 storage of w - 1 rounds a weight outside that
    range, not the reader). A plain concat in place of the regrouping fails here (one key head in
    `hf524_qwen3_next` cannot tell)."""
    hf = _hf_tensors(HYBRID, 5)
    root = str(tmp_path / "megatron")
    os.makedirs(root)
    write_bridge_qwen3_next(root, hf, dict(HYBRID), tp=2, pp=2, padded_vocab=128)
    opened = jobs.open_checkpoint(root)
    assert opened.topology["tp"] == 2 and opened.topology["files"] == 4
    got = {k: v.materialize() for k, v in opened.named.params.items()}
    assert sorted(got) == sorted(hf)
    for k, v in hf.items():
        assert np.array_equal(got[k], v.numpy()), k


def test_bucket_optimizer_state_is_left_out_loudly(tmp_path):
    """A dp_reshardable bucket is a flat walk over the params in module order, which is not
    modelled for the gated delta net: the weights convert, the note says the state is NOT read
    (not a guess at offsets)."""
    hf, cfg = _hf_case()
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0"
    extra = {f"{key}.{s}": torch.zeros(64) for s in ("param", "exp_avg", "exp_avg_sq")}
    write_bridge_qwen3_next(str(tmp_path), hf, cfg, tp=1, pp=2, padded_vocab=128, extra=extra)
    src = open_source(str(tmp_path))
    assert src.optimizer is None
    assert any("optimizer state NOT read: the gated delta net" in n for n in src.notes), src.notes


def _args(**change):
    from hybridckpt.formats.megatron_dist.config import transformer_args

    hf, cfg = _hf_case()
    model = {**provider(cfg, 1, 1), **change}
    return transformer_args(model, 128, "run_config.yaml")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(moe_shared_expert_gate=False), "neither"),
        (dict(attention_output_gate=False), "neither"),
        (dict(experimental_attention_variant="dsa"), "neither"),
        (dict(layernorm_zero_centered_gamma=False), "neither"),
        (dict(mtp_num_layers=1), "mtp_num_layers=1"),
        (dict(linear_attention_freq=[1, 0]), r"linear_attention_freq=\[1, 0\]"),
        (dict(linear_num_key_heads=None), "linear_num_key_heads"),
    ],
)
def test_what_qwen3_next_cannot_express_is_refused(change, match):
    from hybridckpt.formats.megatron.config import hf_config

    assert hf_config(_args(), None, "f")["layer_types"][-1] == "full_attention"
    with pytest.raises(FormatError, match=match):
        hf_config(_args(**change), None, "f")


def test_int_linear_attention_freq_is_megatrons_pattern():
    """`linear_attention_freq: 2` is Megatron's `0 if (i + 1) % 2 == 0 else 1` (1 = linear)."""
    from hybridckpt.formats.megatron.config import hf_config

    kinds = hf_config(_args(linear_attention_freq=2), None, "f")["layer_types"]
    assert kinds == ["linear_attention", "full_attention"] * 2


def test_zero_centred_norms_stay_refused_for_other_families():
    """`apply_layernorm_1p` is read as stored only for Qwen3-Next (HF's norms there are (1+w));
    on a Llama run it is refused in one line, not dropped."""
    from hybridckpt.formats.megatron.config import architecture
    from hybridckpt.formats.megatron.model import Reader

    args = Reader(ckpt("megatron_lm_dense_torch"), None).args
    assert architecture(args, "f").family == "llama"
    args.apply_layernorm_1p = True
    with pytest.raises(
        FormatError, match=r"apply_layernorm_1p=True .* not supported for Llama.*qwen3_next"
    ):
        architecture(args, "f")


def test_sections_that_disagree_with_the_config_are_one_error(tmp_path):
    """A run_config whose delta-net sizes disagree with the stored sections (value heads 2 -> 4):
    one line saying the tensors are not that model's, nothing written."""
    import yaml

    from hybridckpt.errors import ConfigError

    hf, cfg = _hf_case()
    it_dir = write_bridge_qwen3_next(str(tmp_path / "m"), hf, cfg, tp=1, pp=2, padded_vocab=128)
    path = os.path.join(it_dir, "run_config.yaml")
    with open(path) as f:
        run = yaml.safe_load(f)
    run["model"]["linear_num_value_heads"] = 4
    with open(path, "w") as f:
        yaml.safe_dump(run, f)
    store = str(tmp_path / "orbax")
    with pytest.raises(ConfigError, match=r"describes a qwen3_next model .* not that model's") as e:
        jobs.import_checkpoint(str(tmp_path / "m"), store, mesh="dp=1")
    assert "\n" not in str(e.value) and not os.path.exists(store)
