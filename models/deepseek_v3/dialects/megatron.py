"""Megatron-LM's DeepSeek V3: multi-latent attention and a sigmoid router with an expert bias and
shared experts; the args' MLA and router settings become the config.json keys beyond Llama's
(`hf_extra`). The names map by `megatron.rules`; what the facts mean: formats/megatron/config.py.

Router (NVIDIA/Megatron-LM: megatron/core/transformer/moe/moe_utils.py
`topk_routing_with_score_function`): sigmoid scores; `--moe-router-enable-expert-bias` adds the
`expert_bias` buffer for the choice only (HF `e_score_correction_bias`);
`--moe-router-num-groups` / `--moe-router-group-topk` limit the choice to groups ranked by the
sum of their top `topk // group_topk` scores (`group_limited_topk`; HF always sums the top 2);
the k weights are renormalised when k > 1 (HF `norm_topk_prob=True`) and scaled by
`--moe-router-topk-scaling-factor` (HF `routed_scaling_factor`);
`--moe-shared-expert-intermediate-size` S is one shared SwiGLU of width S (HF
`n_shared_experts = S / moe_intermediate_size`); the dense layers (`--moe-layer-freq`) must come
first (HF `first_k_dense_replace`).
Multi-latent attention (`--multi-latent-attention`, megatron/core/transformer/
multi_latent_attention.py, transformer_config.py `MLATransformerConfig`): `--q-lora-rank`
(None: a plain `linear_q_proj`), `--kv-lora-rank`, `--qk-head-dim` (HF `qk_nope_head_dim`),
`--qk-pos-emb-head-dim` (`qk_rope_head_dim`), `--v-head-dim`; the RoPE half of q and k is
de-interleaved before rotation (rope_utils.py `_apply_rotary_pos_emb_bshd`,
`multi_latent_attention=True`) as HF's `rope_interleave=True` does; `--rope-type yarn` (MLA's
default) with `--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim` and the config's
`original_max_position_embeddings` 4096, `beta_fast` 32, `beta_slow` 1 is HF's DeepSeek yarn.
MTP layers (`--mtp-num-layers`) are HF's `num_nextn_predict_layers` (formats/megatron/mtp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridckpt.models.errors import FormatError
from hybridckpt.models.llama.dialects.megatron import HF_KEYS as LLAMA_HF_KEYS
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE, hf_keys_without, positive_int

DESCRIPTION = "DeepSeek V3"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": False,
    "moe": True,
    "mla": True,
    "sigmoid": True,
    "expert_bias": True,
    "shared_experts": True,
}
HF_KEYS = hf_keys_without(LLAMA_HF_KEYS, "head_dim")  # MLA's head dims: hf_extra

# MLATransformerConfig's yarn defaults the args do not carry (transformer_config.py)
MLA_YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}


def router_hf(arg: Callable[..., Any], values: Mapping[str, Any], file: str) -> dict[str, Any]:
    """The `config.json` keys of DeepSeek V3's router and MoE layers (also GLM-4.5's, the same
    router) that the MoE args give; `arg(name, default=None)` reads the args, `values` are the
    format's (`dense_layers`...)."""
    dense = list(values["dense_layers"])
    if dense != list(range(len(dense))):
        raise FormatError(
            f"{file}: dense layers {dense}: this family has dense layers only first "
            f"(first_k_dense_replace)"
        )
    moe_ffn = arg("moe_ffn_hidden_size") or arg("ffn_hidden_size")
    shared = arg("moe_shared_expert_intermediate_size")
    positive_int(moe_ffn, "moe_ffn_hidden_size", file)
    positive_int(shared, "moe_shared_expert_intermediate_size", file)
    if shared % moe_ffn:
        raise FormatError(
            f"{file}: args.moe_shared_expert_intermediate_size={shared} is no multiple of "
            f"moe_ffn_hidden_size={moe_ffn} (HF n_shared_experts)"
        )
    if arg("moe_shared_expert_gate"):
        raise FormatError(
            f"{file}: args.moe_shared_expert_gate=True (a sigmoid gate on the shared expert) "
            f"is not DeepSeek V3's or GLM-4.5's shared expert"
        )
    topk = arg("moe_router_topk", 2)
    groups = arg("moe_router_num_groups") or 1
    group_topk = arg("moe_router_group_topk") or 1
    if groups > 1 and topk // group_topk != 2:
        raise FormatError(
            f"{file}: group-limited routing ranks groups by their top topk // group_topk = "
            f"{topk // group_topk} scores; HF DeepSeek V3 sums the top 2"
        )
    return {
        "n_routed_experts": arg("num_experts"),
        "num_experts_per_tok": topk,
        "moe_intermediate_size": moe_ffn,
        "n_shared_experts": shared // moe_ffn,
        "first_k_dense_replace": len(dense),
        "n_group": groups,
        "topk_group": group_topk,
        "routed_scaling_factor": float(arg("moe_router_topk_scaling_factor") or 1.0),
        "norm_topk_prob": topk > 1,
    }


def hf_extra(arg: Callable[..., Any], values: Mapping[str, Any], file: str) -> dict[str, Any]:
    """The DeepSeek V3 `config.json` keys beyond Llama's that MLA / MoE args give;
    `arg(name, default=None)` reads the args, `values` are the format's (`dense_layers`...)."""
    out = {
        **router_hf(arg, values, file),
        "q_lora_rank": arg("q_lora_rank"),
        "kv_lora_rank": arg("kv_lora_rank"),
        "qk_nope_head_dim": arg("qk_head_dim"),
        "qk_rope_head_dim": arg("qk_pos_emb_head_dim"),
        "v_head_dim": arg("v_head_dim"),
        "num_nextn_predict_layers": arg("mtp_num_layers") or 0,
        "rope_interleave": True,
    }
    if arg("mtp_use_repeated_layer") and (arg("mtp_num_layers") or 0) > 1:
        raise FormatError(
            f"{file}: args.mtp_use_repeated_layer with mtp_num_layers={arg('mtp_num_layers')}"
            f": one stored MTP layer applied at every depth, which HF DeepSeek V3 has no name for"
        )  # multi_token_prediction.py `_build_layers`
    rope = arg("rope_type") or "yarn"  # arguments.py: "MLA takes yarn by default"
    factor = float(arg("rotary_scaling_factor", 1.0) or 1.0)
    if rope == "yarn" and factor != 1.0:
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": factor,
            "mscale": float(arg("mscale", 1.0)),
            "mscale_all_dim": float(arg("mscale_all_dim", 0.0)),
            **{k: arg(k, v) for k, v in MLA_YARN_DEFAULTS.items()},
        }
    return out
