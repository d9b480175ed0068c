"""MaxText's Mistral (decoder_block "mistral"): Llama's names, layouts and value ops
(`RULES`: models/llama/dialects/maxtext.rules; the query pre-scaled, no RoPE permutation: Mistral
has no Llama 3 rope scaling). Not run against MaxText here (docs/maxtext.md says which families
were); MaxText's Mistral honours `sliding_window_size` only through its own config."""

from __future__ import annotations

from typing import Any

from hybridckpt.models.llama.dialects import maxtext as _llama

RULES = "hybridckpt.models.llama.dialects:maxtext.rules"
MODEL_NAME = "mistral-7b"
variables = _llama.variables
notes = _llama.notes


def overrides(cfg) -> dict[str, Any]:
    return {**_llama.overrides(cfg), "decoder_block": "mistral"}
