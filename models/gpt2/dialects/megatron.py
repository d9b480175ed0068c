"""Megatron-LM's GPT-2: LayerNorm, GELU, learned absolute positions; the names map by
`megatron.rules`. What the facts mean: formats/megatron/config.py.
"""

DESCRIPTION = "GPT-2"
MATCH = {
    "normalization": "LayerNorm",
    "swiglu": False,
    "position_embedding": "learned_absolute",
}
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "n_embd",
    "ffn_hidden_size": "n_inner",
    "num_layers": "n_layer",
    "num_heads": "n_head",
    "norm_eps": "layer_norm_epsilon",
    "max_positions": "n_positions",
}
# (when, text): remarks `inspect` shows when every fact in `when` has the given value
NOTES = (
    (
        {"openai_gelu": False},
        "Megatron's GELU is erf-based (F.gelu); GPT2LMHeadModel uses gelu_new (tanh approximation)",
    ),
    (
        {"tied": False},
        "untied output layer: GPT2LMHeadModel ties lm_head to wte and ignores lm_head.weight",
    ),
)
