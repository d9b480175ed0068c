"""Mistral's native layout (mistralai/mistral-inference: `params.json` plus
`consolidated.safetensors`, or one `consolidated.00.pth`): the tensors are named and rotated as in
Meta's reference code, so Llama's `meta.rules` maps them (RULES); the reader is
formats/meta_llama.py.

`params.json` is `TransformerArgs` (mistral_inference/args.py): `dim`, `n_layers`, `head_dim`,
`hidden_dim` (the SwiGLU width), `n_heads`, `n_kv_heads`, `norm_eps`, `vocab_size`, optional
`rope_theta`, `sliding_window` (`_sliding_window` in some releases), `moe`, `lora`,
`vision_encoder`. `hidden_dim` and `head_dim` (absent from Meta's `ModelArgs`) mark it. It
becomes an HF MistralConfig dict as transformers' own converter writes it
(huggingface/transformers:src/transformers/models/mistral/convert_mistral_weights_to_hf.py
`convert_config`: `sliding_window` may be a string; `max_seq_len` or 32768 for
max_position_embeddings). A missing `rope_theta` is 1e6 without a sliding window and 1e4 with one
(mistral-inference@b818190 transformer.py, the rule Mistral 7B v0.1's windowed params.json was
released under; HF's conversion of it says 10000). Refused: `vision_encoder` (Pixtral) and
per-layer `sliding_window` lists that differ between layers: no family implements them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridckpt.models.errors import ConfigError, UnknownModelError

PARAMS = ("hidden_dim", "head_dim")  # params.json keys that mark the family
RULES = "hybridckpt.models.llama.dialects:meta.rules"


def _sliding_window(params: Mapping[str, Any], source: str):
    w = params.get("sliding_window", params.get("_sliding_window"))
    if isinstance(w, list):  # per-layer windows (mistral-inference args.py allows a list)
        if not w or len(set(w)) != 1:
            raise UnknownModelError(
                f"{source}: sliding_window {w} differs between layers; no family implements "
                f"per-layer windows"
            )
        w = w[0]
    if isinstance(w, str):  # "This may sometimes be a string in `params.json`" (convert_config)
        try:
            w = int(w)
        except ValueError:
            raise ConfigError(f"{source}: sliding_window {w!r} is not an integer") from None
    return w


def hf_config(params: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The HF MistralConfig dict transformers' `convert_config` writes for this params.json."""
    if params.get("vision_encoder"):
        raise UnknownModelError(
            f"{source}: 'vision_encoder': a vision encoder (Pixtral) is not implemented by any family"
        )
    missing = [
        k for k in ("dim", "n_layers", "n_heads", "norm_eps", "vocab_size") if k not in params
    ]
    if missing:
        raise ConfigError(f"{source}: a Mistral params.json needs {missing}")
    window = _sliding_window(params, source)
    theta = params.get("rope_theta")
    if theta is None:
        theta = 1e6 if window is None else 1e4
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": params["dim"],
        "num_hidden_layers": params["n_layers"],
        "intermediate_size": params["hidden_dim"],
        "num_attention_heads": params["n_heads"],
        "num_key_value_heads": params.get("n_kv_heads") or params["n_heads"],
        "head_dim": params["head_dim"],
        "rms_norm_eps": params["norm_eps"],
        "vocab_size": params["vocab_size"],
        "rope_theta": theta,
        "sliding_window": window,
        "max_position_embeddings": params.get("max_seq_len", 32768),
        "tie_word_embeddings": False,
    }


def config(params: Mapping[str, Any], vocab_size: int | None, source: str):
    """The MistralConfig of a Mistral params.json (its own `vocab_size`; the argument unused)."""
    from hybridckpt.models.api import config_from_hf

    return config_from_hf(hf_config(params, source), source=source)
