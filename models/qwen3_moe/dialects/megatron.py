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

DESCRIPTION = "Qwen3-MoE"
MATCH = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding": "rope",
    "qkv_bias": False,
    "qk_layernorm": True,
    "moe": True,
    "sigmoid": False,
    "expert_bias": False,
    "shared_experts": False,
    "grouped": False,
    "scaled": False,
}
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tied": "tie_word_embeddings",
    "max_positions": "max_position_embeddings",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "num_experts": "num_experts",
    "moe_topk": "num_experts_per_tok",
    "norm_topk_prob": "norm_topk_prob",
    "dense_layers": "mlp_only_layers",
}
