"""Megatron-LM's Llama: the args that describe one and the config.json keys they give.

RMSNorm, SwiGLU, RoPE (half-split, as HF's), no linear biases, no q/k norms; the names map by
`megatron.rules`. What the facts mean: formats/megatron/config.py.
"""

from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE

DESCRIPTION = "Llama"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": False,
    "qk_layernorm": False,
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
}

# `export --to megatron` writes this family (formats/megatron_dist/write.py: dense, checked by
# megatron-core's own load_checkpoint)
EXPORTED = True
