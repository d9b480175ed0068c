"""Meta's reference code (`params.json` + `consolidated.NN.pth`; meta-llama/llama and
meta-llama/llama3 `llama/model.py` `ModelArgs`): Meta's `params.json` is Llama's, read by the
family's `config_from_meta` (`dim`, `n_layers`, `n_heads`, `n_kv_heads`, `multiple_of`,
`ffn_dim_multiplier`, `norm_eps`, `rope_theta`, `use_scaled_rope`); the names map by
`meta.rules`. The reader: formats/meta_llama.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PARAMS: tuple[str, ...] = ()  # params.json keys that mark the family: none (Meta's own)


def config(params: Mapping[str, Any], vocab_size: int | None, source: str):
    """The LlamaConfig of Meta's `params.json` (`vocab_size` when it says -1)."""
    from hybridckpt.models.llama import FAMILY

    return FAMILY.config_from_meta(params, vocab_size, source)
