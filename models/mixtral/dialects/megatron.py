"""Megatron-LM's Mixtral: Llama's attention, every layer a mixture of SwiGLU experts
(`--num-experts`) under a softmax router over the routed experts only.

Megatron's default router (top-k of the logits, then a softmax over the k: moe/moe_utils.py
`topk_routing_with_score_function`, `use_pre_softmax=False`) equals HF's softmax over all
experts, top-k, renormalised (Mixtral), so `--moe-router-pre-softmax` is refused
(no renormalisation: Qwen3-MoE's `norm_topk_prob=False`), as are dense layers (`--moe-layer-freq`),
sigmoid scores, an expert bias, shared experts, group-limited or scaled routing. Mixtral has no
dense MLP, so its `intermediate_size` is the experts'. What the facts mean:
formats/megatron/config.py; the names map by `megatron.rules`.
"""

from hybridckpt.models.llama.dialects.megatron import HF_KEYS as LLAMA_HF_KEYS
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE, SOFTMAX_ROUTER, hf_keys_without

DESCRIPTION = "Mixtral"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": False,
    "qk_layernorm": False,
    "moe": True,
    "pre_softmax": False,
    "dense_layers": False,
    **SOFTMAX_ROUTER,
    "shared_experts": False,
}
HF_KEYS = {
    **hf_keys_without(LLAMA_HF_KEYS, "ffn_hidden_size"),  # no dense MLP: the experts' width is it
    "moe_ffn_hidden_size": "intermediate_size",
    "num_experts": "num_local_experts",
    "moe_topk": "num_experts_per_tok",
}
