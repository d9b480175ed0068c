"""MaxText's Mistral (decoder_block "mistral"): Llama's names, layouts and value ops
(`RULES`: models/llama/dialects/maxtext.rules; the query pre-scaled, no RoPE permutation: Mistral
has no Llama 3 rope scaling). Run in MaxText 0.2.5 (tests/real case `maxtext_mistral`, weights
only: its forward matches HF's without a window). MaxText's mistral block attends globally: its
models/mistral.py builds the Attention without `attention_type`, so `sliding_window_size` is never
applied; a model with a sliding window is written (the weights are right) with a note."""

from __future__ import annotations

from typing import Any

from hybridckpt.models.llama.dialects import maxtext as _llama

RULES = "hybridckpt.models.llama.dialects:maxtext.rules"
MODEL_NAME = "mistral-7b"
variables = _llama.variables


def notes(cfg) -> list[str]:
    """Llama's notes, and the sliding window MaxText's mistral block does not apply."""
    out = _llama.notes(cfg)
    window = getattr(cfg, "sliding_window", None)
    if window is not None:
        out.append(
            f"MaxText's mistral decoder attends globally (no sliding window); this model windows attention to "
            f"{window} tokens: MaxText will differ from the source on sequences longer than that"
        )
    return out


def overrides(cfg) -> dict[str, Any]:
    return {**_llama.overrides(cfg), "decoder_block": "mistral"}
