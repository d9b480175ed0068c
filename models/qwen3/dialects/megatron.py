"""Megatron-LM's Qwen3: Llama's layout with per-head q/k norms (`--qk-layernorm`), no biases,
the config.json keys Llama's.

What the facts mean: formats/megatron/config.py; the names map by `megatron.rules`.
"""

from hybridckpt.models.llama.dialects.megatron import HF_KEYS as LLAMA_HF_KEYS
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE

DESCRIPTION = "Qwen3"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": False,
    "qk_layernorm": True,
}
HF_KEYS = LLAMA_HF_KEYS  # the same config.json keys

# `export --to megatron` writes this family (formats/megatron_dist/write.py: dense, checked by
# megatron-core's own load_checkpoint)
EXPORTED = True
