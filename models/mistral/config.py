"""Mistral family config and its HF form and rule variables (no JAX).

HF `config.json` (`from_hf` / `to_hf`): architectures `MistralForCausalLM` (or, when
`architectures` is absent, `model_type` "mistral"). Every key Mistral shares with Llama (sizes,
`head_dim`, `rms_norm_eps`, `max_position_embeddings`, RoPE from `rope_theta` + `rope_scaling`
or `rope_parameters`) is read and written by Llama's own reader and writer
(`models.llama.config`), so RoPE is parsed, checked and written back exactly as for Llama.
Mistral adds `sliding_window` (a positive int, or null for plain causal attention); when the key
is absent transformers' `MistralConfig` default applies (4096), as it does for
`max_position_embeddings` (131072). `MistralConfig` has no `attention_bias` / `mlp_bias`, so
`to_hf` leaves those Llama keys out.

Rule variables and params are Llama's (same tensors: `models.llama.params`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama

ARCHITECTURE = "MistralForCausalLM"
HF_DEFAULTS = {"sliding_window": 4096, "max_position_embeddings": 4096 * 32}  # MistralConfig's


@dataclasses.dataclass(frozen=True)
class MistralConfig(llama.LlamaConfig):
    """Mistral: LlamaConfig's fields plus `sliding_window` (None: plain causal attention)."""

    sliding_window: int | None = HF_DEFAULTS["sliding_window"]

    def __post_init__(self) -> None:
        super().__post_init__()
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(
                f"MistralConfig.sliding_window: expected a positive int or None, found {w!r}"
            )

    @property
    def family(self) -> str:
        return "mistral"


def from_hf(d: Mapping[str, Any], source: str) -> MistralConfig:
    """A MistralConfig from an HF `config.json` dict; `source` names the file in errors."""
    require(d, llama.HF_REQUIRED, source, ARCHITECTURE)
    view = {**HF_DEFAULTS, **d}
    cfg = llama.from_hf(view, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return MistralConfig(**fields, sliding_window=view["sliding_window"])


def to_hf(cfg: MistralConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a MistralForCausalLM."""
    d = llama.to_hf(cfg)
    for key in ("attention_bias", "mlp_bias"):
        del d[key]
    return d | {
        "architectures": [ARCHITECTURE],
        "model_type": "mistral",
        "sliding_window": cfg.sliding_window,
    }


def rule_variables(cfg: MistralConfig) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`, as Llama's)."""
    return llama.rule_variables(cfg)
