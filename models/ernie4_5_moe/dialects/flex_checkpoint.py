"""PaddleFormers' FlexCheckpoint (formats/flex_checkpoint) of ERNIE 4.5 MoE: PaddleFormers' own
module names (fused `qkv_proj` / `up_gate_proj`) and Paddle's `[in, out]` Linear weights; the
attention and dense MLPs are the dense family's rules, the sparse block this family's."""

RULES = (
    "hybridckpt.models.ernie4_5.dialects:flex_checkpoint.rules",
    "hybridckpt.models.ernie4_5_moe.dialects:flex_checkpoint.rules",
)
