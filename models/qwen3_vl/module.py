"""Qwen3-VL in Flax linen: the text model of `Qwen3VLForConditionalGeneration` as transformers
computes it for a prompt with no image (huggingface/transformers:src/transformers/models/
qwen3_vl/modeling_qwen3_vl.py: `Qwen3VLModel.forward` embeds the tokens and runs
`Qwen3VLTextModel`; the wrapper applies `lm_head`).

The text model is Qwen3's block (`models.qwen2.module.QwenBlock` with per-head q/k norms) whose
RoPE is M-RoPE (`models.qwen3_vl.mrope`): the module takes optional `position_ids`
(`[3, batch, seq]` temporal/height/width, or `[batch, seq]`; None: `arange(seq)` on all three,
which is plain RoPE). With no image, DeepStack adds nothing (transformers adds the tower's
merged features to the first layers' hidden states only at image positions).

The vision tower (`vision.*`) is created from the table so the params tree is the checkpoint's
whole, and carried; no vision forward is implemented.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Embed, TableGroup, output_logits
from hybridckpt.models.llama.module import RMSNorm
from hybridckpt.models.qwen3.module import Qwen3
from hybridckpt.models.qwen3_vl.mrope import mrope_tables, position_ids_3d


class QwenVL(Qwen3):
    """tokens `[batch, seq]` int (and optional `position_ids`) -> logits `[batch, seq, vocab]`
    float32 (text only); serves Qwen3-VL and Qwen2.5-VL (the block and table are the config's
    family's)."""

    @nn.compact
    def __call__(self, tokens: jax.Array, position_ids: jax.Array | None = None) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        TableGroup(name="vision")()
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = mrope_tables(cfg, position_ids_3d(position_ids, *tokens.shape))
        x, _ = self.block()(x, cos, sin)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        return output_logits(x, embed, cfg.tie_word_embeddings, dt).astype(jnp.float32)
