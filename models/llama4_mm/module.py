"""Llama 4 multimodal in Flax linen: the text model of `Llama4ForConditionalGeneration`, as
transformers 5.24 computes it for a prompt with no image (modeling_llama4.py: the wrapper embeds
the tokens with `language_model`'s embedding and runs `language_model`, a Llama4ForCausalLM,
whose head gives the logits): the Llama 4 text module (`models.llama4.module`) on the same params.
transformers 5.24's wrapper `forward` itself raises on every call (its output class is given an
`image_outputs` its text model does not return), so its `.language_model` is the reference.

The vision tower and the projector (`vision.*`, `projector.*`) are created from the table so
the params tree is the checkpoint's whole, and carried; no vision forward is implemented (an
image's soft tokens are not computed).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from hybridckpt.models.common import TableGroup
from hybridckpt.models.llama4.module import Llama4


class Llama4MM(Llama4):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (text only)."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        TableGroup(name="vision")()
        TableGroup(name="projector")()
        return super().__call__(tokens)
