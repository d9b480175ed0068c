"""Megatron-LM's Qwen3: Llama's layout with per-head q/k norms (`--qk-layernorm`), no biases,
the config.json keys Llama's.

What the facts mean: formats/megatron/config.py; the names map by `megatron.rules`.
"""

DESCRIPTION = "Qwen3"
MATCH = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding": "rope",
    "qkv_bias": False,
    "qk_layernorm": True,
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

# `export --to megatron` writes this family (writers/megatron_dist.py: dense, checked by
# megatron-core's own load_checkpoint)
EXPORTED = True
