"""torchtitan's Qwen3 (dense; formats/dcp/torchtitan.py): per-head q/k norms mark it
(`attention.k_norm`: DeepSeek V3's MLA has a `q_norm` too, never a `k_norm`); its names map by
`torchtitan.rules`, no RoPE rows permuted (torchtitan's Qwen3 rotates half-split, as HF)."""

MARKERS = (".attention.k_norm.",)  # substrings some tensor name holds
NOTE = "no RoPE permutation"

# torchtitan 0.3 trains this family dense: `export --to torchtitan` writes it (formats/dcp/write_torchtitan.py)
EXPORTED = True
