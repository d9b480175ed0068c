"""Megatron-LM's GLM-4.5 (GLM-4.5, -Air, -4.6 as Megatron-Core / Megatron-Bridge train them): a
GPTModel with GQA attention, q/k biases (`--add-qkv-bias`), per-head q/k RMSNorm
(`--qk-layernorm`, GLM-4.5; absent in -Air), half the head dims rotated (`--rotary-percent 0.5`),
first dense layers (`--moe-layer-freq [0]*k+[1]*n`) and DeepSeek V3's router: sigmoid scores
(`--moe-router-score-function sigmoid`), `--moe-router-enable-expert-bias` (HF
`e_score_correction_bias`, for the choice only), `--moe-router-topk-scaling-factor` (HF
`routed_scaling_factor`), groups, and one shared SwiGLU (`--moe-shared-expert-intermediate-size`).
The facts are NVIDIA-NeMo/Megatron-Bridge:src/megatron/bridge/models/glm/glm45_bridge.py
(`provider_bridge`: `add_qkv_bias=attention_bias`, `qk_layernorm=use_qk_norm`,
`rotary_percent=partial_rotary_factor`, `moe_router_score_function="sigmoid"`,
`moe_router_enable_expert_bias=True`, `moe_layer_freq=[0]*first_k_dense_replace+[1]*...`,
`moe_shared_expert_intermediate_size=moe_intermediate_size*n_shared_experts`) and the GLM-4.5
launch arguments (slime scripts/models/glm4.5-355B-A32B.sh); the router's computation is
DeepSeek V3's (models/deepseek_v3/dialects/megatron.py, `router_hf`).

Partial RoPE: Megatron's `RotaryEmbedding(kv_channels, rotary_percent)` builds frequencies over
`int(kv_channels * rotary_percent)` dims and `_apply_rotary_pos_emb_bshd` turns the first that
many dims of each head half-split (rotate_half), the rest passed through: HF GLM-4.5's
`partial_rotary_factor` over `int(head_dim * factor)` dims, the same (`ROTARY_PERCENT`).
MTP layers (`--mtp-num-layers`, Bridge's GLM-4.5 trains one) are HF's `num_nextn_predict_layers`
modules `model.layers.{L+i}.*` (DeepSeek V3's layout; formats/megatron/mtp.py numbers them).
The names map by `megatron.rules`; what the facts mean: formats/megatron/config.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridckpt.models.deepseek_v3.dialects.megatron import router_hf
from hybridckpt.models.errors import FormatError
from hybridckpt.models.llama.dialects.megatron import HF_KEYS as LLAMA_HF_KEYS
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE

DESCRIPTION = "GLM-4.5"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "linear_bias": False,
    "moe": True,
    "sigmoid": True,
    "expert_bias": True,
    "shared_experts": True,
}
HF_KEYS = dict(LLAMA_HF_KEYS)
# the HF key that takes `args.rotary_percent` (formats/megatron/config.py: partial RoPE is read
# only for a family naming it)
ROTARY_PERCENT = "partial_rotary_factor"


def hf_extra(arg: Callable[..., Any], values: Mapping[str, Any], file: str) -> dict[str, Any]:
    """The GLM-4.5 `config.json` keys beyond Llama's: the router's (`router_hf`), q/k biases
    and norms; `arg(name, default=None)` reads the args."""
    mtp = arg("mtp_num_layers") or 0
    if arg("mtp_use_repeated_layer") and mtp > 1:
        raise FormatError(
            f"{file}: args.mtp_use_repeated_layer with mtp_num_layers={mtp}: one stored MTP "
            f"layer applied at every depth, which HF GLM-4.5 has no name for"
        )  # multi_token_prediction.py `_build_layers`
    return {
        **router_hf(arg, values, file),
        "attention_bias": bool(arg("add_qkv_bias") or arg("add_bias_linear")),
        "use_qk_norm": bool(arg("qk_layernorm")),
        "num_nextn_predict_layers": mtp,
    }
