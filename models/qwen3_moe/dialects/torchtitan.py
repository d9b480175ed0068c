"""torchtitan's Qwen3-MoE (formats/dcp/torchtitan.py): Qwen3's attention (its q/k norms) with MoE
layers (`moe.`); the names map by Qwen3's torchtitan rules, then this folder's for the MoE
layers. HF Qwen3-MoE has no expert bias: torchtitan's load-balancing bias is dropped (noted)."""

MARKERS = (".attention.k_norm.", ".moe.")  # substrings some tensor name holds
NOTE = "no RoPE permutation"
RULES = (
    "hybridckpt.models.qwen3.dialects:torchtitan.rules",
    "hybridckpt.models.qwen3_moe.dialects:torchtitan.rules",
)
KEEPS_EXPERT_BIAS = False
