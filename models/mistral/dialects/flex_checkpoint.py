"""PaddleFormers' FlexCheckpoint (formats/flex_checkpoint): HF names, nn.Linear weights in
Paddle's `[in, out]`; the Linear weights are Llama's, so Llama's rules transpose them."""

RULES = "hybridckpt.models.llama.dialects:flex_checkpoint.rules"
