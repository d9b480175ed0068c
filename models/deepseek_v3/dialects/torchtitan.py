"""torchtitan's DeepSeek V3 (formats/dcp/torchtitan.py): multi-latent attention (`attention.wkv_a`)
marks it; its names map by `torchtitan.rules`, no RoPE rows permuted (both rotate interleaved
pairs); its load-balancing expert bias is HF's `e_score_correction_bias` (kept, zero moments)."""

MARKERS = (".attention.wkv_a.",)  # substrings some tensor name holds
NOTE = "no RoPE permutation"
KEEPS_EXPERT_BIAS = True
# rule variables true when some tensor name holds the substring
FLAGS = {"q_lora": ".attention.wq_a.", "mtp": "mtp_layers."}
