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

DESCRIPTION = "Mixtral"
MATCH = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding": "rope",
    "qkv_bias": False,
    "qk_layernorm": False,
    "moe": True,
    "pre_softmax": False,
    "dense_layers": False,
    "sigmoid": False,
    "expert_bias": False,
    "shared_experts": False,
    "grouped": False,
    "scaled": False,
}
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tied": "tie_word_embeddings",
    "max_positions": "max_position_embeddings",
    "moe_ffn_hidden_size": "intermediate_size",
    "num_experts": "num_local_experts",
    "moe_topk": "num_experts_per_tok",
}
