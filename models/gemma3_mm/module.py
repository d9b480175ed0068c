"""Gemma 3 multimodal in Flax linen: the text model of `Gemma3ForConditionalGeneration`, as
transformers computes it for a prompt with no image (huggingface/transformers:src/transformers/
models/gemma3/modeling_gemma3.py: `Gemma3Model.forward` embeds the tokens and runs
`language_model`, the Gemma 3 text model; `Gemma3ForConditionalGeneration` applies the head and
no final soft-cap): the Gemma 3 text module (`models.gemma3.module`) on the same params, less
its final logit soft-cap: `Gemma3ForConditionalGeneration.forward` (transformers 4.57 and 5.24
alike) never applies `text_config.final_logit_softcapping`, which Gemma3ForCausalLM applies
(null in every release, so the two agree on the released models).

The vision tower and the projector (`vision.*`, `projector.*`) are created from the table so
the params tree is the checkpoint's whole, and carried; no vision forward is implemented (an
image's soft tokens are not computed).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from hybridckpt.models.common import TableGroup
from hybridckpt.models.gemma3.module import Gemma3


class Gemma3MM(Gemma3):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (text only)."""

    def final_softcap(self) -> float | None:
        return None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        TableGroup(name="vision")()
        TableGroup(name="projector")()
        return super().__call__(tokens)
