"""Mistral in Flax linen: Llama's module (`models.llama.module.Llama`) with its attention window
set to the config's `sliding_window`, numerically like transformers' MistralForCausalLM
(huggingface/transformers:src/transformers/models/mistral/modeling_mistral.py: the Llama
forward pass with `create_sliding_window_causal_mask`: query i sees keys i - window < j <= i).

Params: exactly Llama's tree (see `models.llama.module`).
"""

from __future__ import annotations

from hybridckpt.models.llama.module import Llama


class Mistral(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    def sliding_window(self) -> int | None:
        return self.cfg.sliding_window
