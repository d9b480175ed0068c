"""Megatron-LM's Qwen3-MoE: Qwen3's attention (`--qk-layernorm`) with a mixture of SwiGLU
experts (`--num-experts`) under a softmax router over the routed experts only.

Megatron's default router (top-k of the logits, then a softmax over the k: moe/moe_utils.py
`topk_routing_with_score_function`, `use_pre_softmax=False`) equals HF's softmax over all
experts, top-k, renormalised: Qwen3-MoE's `norm_topk_prob=True`; `--moe-router-pre-softmax` (softmax, top-k, no
renormalisation) is its `norm_topk_prob=False` (Megatron-Bridge qwen3_moe_bridge.py:
`moe_router_pre_softmax = not norm_topk_prob`). Dense layers (`--moe-layer-freq`) are its
`mlp_only_layers`. What the facts mean: formats/megatron/config.py; the names map by
`megatron.rules`.
"""

from hybridckpt.models.llama.dialects.megatron import HF_KEYS as LLAMA_HF_KEYS
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE, SOFTMAX_ROUTER

DESCRIPTION = "Qwen3-MoE"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": False,
    "qk_layernorm": True,
    "moe": True,
    **SOFTMAX_ROUTER,
    "shared_experts": False,
}
HF_KEYS = {
    **LLAMA_HF_KEYS,
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "num_experts": "num_experts",
    "moe_topk": "num_experts_per_tok",
    "norm_topk_prob": "norm_topk_prob",
    "dense_layers": "mlp_only_layers",
}
