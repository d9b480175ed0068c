"""Mistral 3 in Flax linen: the text model of `Mistral3ForConditionalGeneration`, as transformers
computes it for a prompt with no image (huggingface/transformers:src/transformers/models/
mistral3/modeling_mistral3.py: `Mistral3Model.forward` embeds the tokens and runs
`language_model`, a MistralModel; the wrapper applies `lm_head`, tied to the embedding or not):
the Mistral module (`models.mistral.module`) on the same params.

The Pixtral vision tower and the projector (`vision.*`, `projector.*`) are created from the
table so the params tree is the checkpoint's whole, and carried; no vision forward is
implemented (an image's tokens are not computed).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from hybridckpt.models.common import TableGroup
from hybridckpt.models.mistral.module import Mistral


class Mistral3(Mistral):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (text only)."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        TableGroup(name="vision")()
        TableGroup(name="projector")()
        return super().__call__(tokens)
