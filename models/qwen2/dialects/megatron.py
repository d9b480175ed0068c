"""Megatron-LM's Qwen2: Llama's layout with the q/k/v biases alone (`--add-qkv-bias` with
`--disable-bias-linear`: `add_bias_linear` false), the config.json keys Llama's.

What the facts mean: formats/megatron/config.py; the names map by `megatron.rules`.
"""

from hybridckpt.models.llama.dialects.megatron import HF_KEYS as LLAMA_HF_KEYS
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE

DESCRIPTION = "Qwen2"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": True,
    "linear_bias": False,
    "qk_layernorm": False,
}
HF_KEYS = LLAMA_HF_KEYS  # the same config.json keys

# `export --to megatron` writes this family (formats/megatron_dist/write.py: dense, checked by
# megatron-core's own load_checkpoint)
EXPORTED = True
