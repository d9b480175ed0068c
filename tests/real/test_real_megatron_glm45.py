"""GLM-4.5 as Megatron itself writes it: a GLM-4.5-like GPTModel trained and saved by Megatron-LM /
megatron-core 0.19.2 (tests/real/generators/megatron_core.py, run `glm45`: tp2 pp2 on gloo CPU
ranks, model only) as torch_dist and as the legacy torch format, read through GLM-4.5's megatron
dialect (models/glm4_moe/dialects/megatron.*).

What the save holds, and what makes it GLM-4.5 rather than DeepSeek V3 or Qwen3-MoE: a first dense
layer (`--moe-layer-freq [0,1]`), q/k/v biases (`--add-qkv-bias`, linear_qkv.bias per query group),
per-head q/k RMSNorm (`--qk-layernorm`), half of each head's 8 dims rotated (`--rotary-percent 0.5`),
a sigmoid router whose `expert_bias` (trained by Megatron's own update, nonzero) picks the experts,
top-k weights renormalised and scaled by 2.5, one shared expert, and one MTP layer (HF's
`model.layers.4.*`, carried bitwise, unused by the forward).
Checked: the config the args give; every param (and the router bias) bitwise against the params a
tp = pp = 1 Megatron model holds after loading the save (Megatron's own resharding), through
import on a tp/pp mesh, restore on another, export; the logits of the imported model against
GPTModel's own eval forward on fixed tokens (fp32, atol 2e-5: both sides fp32, a 2-layer model of
hidden 16, different reduction orders; measured ~5e-7).
"""

from __future__ import annotations

import cases
import numpy as np
import pytest
from megatron_reference import assert_bitwise, assert_logits_equal_megatron, glm45_to_hf, tp_pp_mesh

TORCH_DIST = "megatron_core_glm45_torch_dist"
TORCH = "megatron_lm_glm45_torch"  # the same trained state, legacy `--ckpt-format torch`
DIMS = {"vocab": 60, "heads": 4, "groups": 2}
LAYERS = 4  # decoder layers; the MTP layer is HF's model.layers.4
MESH_A, MESH_B = "fsdp=2,tp=2,pp=2", "dp=2,tp=2,pp=2"


def test_config_from_megatron_args():
    """The args say GLM-4.5 and give its fields (what Megatron-Bridge's glm45_bridge sets from
    them), among them the partial rotary the format refuses for the other families."""
    from hybridckpt.formats.registry import open_source
    from hybridckpt.models.glm4_moe.config import Glm4MoeConfig

    for case in (TORCH_DIST, TORCH):
        cfg = open_source(cases.ckpt(case)).config
        assert isinstance(cfg, Glm4MoeConfig), (case, type(cfg))
        got = {k: getattr(cfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "n_routed_experts", "num_experts_per_tok",
            "n_shared_experts", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor",
            "partial_rotary_factor", "rope_theta", "attention_bias", "use_qk_norm",
            "tie_word_embeddings", "n_group", "num_nextn_predict_layers", "mtp_layers")}  # fmt: skip
        assert got == {
            "vocab_size": 60, "hidden_size": 16, "intermediate_size": 24, "moe_intermediate_size": 8,
            "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 2,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5,
            "rope_theta": 1e6, "attention_bias": True, "use_qk_norm": True,
            "tie_word_embeddings": False, "n_group": 1, "num_nextn_predict_layers": 1, "mtp_layers": 1,
        }, case  # fmt: skip


def test_reference_is_glm_like():
    """The fixture exercises what it claims: Megatron's trained expert bias is not zero (else the
    router's choice would not depend on it), the q/k/v biases are not zero."""
    ref = cases.reference(TORCH_DIST)
    bias = ref["buffer/decoder.layers.2.mlp.router.expert_bias"]
    assert bias.shape == (4,) and np.abs(bias).max() > 0
    assert np.abs(ref["param/decoder.layers.0.self_attention.linear_qkv.bias"]).max() > 0


@pytest.mark.parametrize("case", [TORCH_DIST, TORCH])
def test_params_bitwise_through_import_restore_export(case, tmp_path):
    from e2e import roundtrip

    params, _, _, _ = roundtrip(cases.ckpt(case), str(tmp_path), mesh_a=MESH_A, mesh_b=MESH_B, optimizer=False)
    want = glm45_to_hf(cases.reference(TORCH_DIST), **DIMS, layers=LAYERS)
    assert "model.layers.4.eh_proj.weight" in want and "model.layers.4.mlp.gate.e_score_correction_bias" in want
    assert_bitwise(params, want)


def test_logits_equal_megatron_forward():
    """On the torch_dist case (the legacy torch case's params are the same bits: above)."""
    assert_logits_equal_megatron(cases.ckpt(TORCH_DIST), cases.reference(TORCH_DIST), DIMS["vocab"], tp_pp_mesh())


def _args(case: str):
    """The args Megatron saved with the legacy torch case (an argparse.Namespace), fresh."""
    from hybridckpt.formats.megatron.model import Reader

    return Reader(cases.ckpt(case), None).args


def test_glm_air_and_bias_free_args_give_their_flags():
    """GLM-4.5-Air trains without `--qk-layernorm`; a run without `--add-qkv-bias` has no q/k/v
    biases: the args' flags become HF's `use_qk_norm` / `attention_bias`, not constants."""
    from hybridckpt.formats.megatron.config import hf_config

    args = _args(TORCH)
    args.qk_layernorm, args.add_qkv_bias = False, False
    d = hf_config(args, None, "f")
    assert d["architectures"] == ["Glm4MoeForCausalLM"]
    assert (d["use_qk_norm"], d["attention_bias"], d["partial_rotary_factor"]) == (False, False, 0.5)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate=True"),
        (dict(mtp_num_layers=2, mtp_use_repeated_layer=True), "mtp_use_repeated_layer"),
        (dict(moe_layer_freq=[0, 1, 0, 1]), r"dense layers \[0, 2\]"),
        (dict(moe_router_enable_expert_bias=False), "expert_bias=False.*neither"),
        (dict(add_bias_linear=True), "linear_bias=True.*neither"),
        (dict(moe_ffn_hidden_size=0, ffn_hidden_size=None), "moe_ffn_hidden_size=None: expected a positive int"),
        (dict(moe_shared_expert_intermediate_size="8"), "moe_shared_expert_intermediate_size='8'"),
    ],
)
def test_what_glm_cannot_express_is_refused(change, match):
    from hybridckpt.errors import FormatError
    from hybridckpt.formats.megatron.config import hf_config

    args = _args(TORCH)
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(FormatError, match=match):
        hf_config(args, None, "f")


def test_partial_rope_stays_refused_for_families_without_it():
    """`--rotary-percent` is read only where the family names its HF key (GLM-4.5's
    partial_rotary_factor); on a Llama run it is refused in one line, not dropped."""
    from hybridckpt.errors import FormatError
    from hybridckpt.formats.megatron.config import architecture

    args = _args("megatron_lm_dense_torch")
    assert architecture(args, "f").family == "llama"
    args.rotary_percent = 0.5
    with pytest.raises(FormatError, match=r"rotary_percent=0.5 \(partial RoPE\) is not supported for Llama.*glm4_moe"):
        architecture(args, "f")
