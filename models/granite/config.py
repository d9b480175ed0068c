"""Granite family config and its HF form and rule variables (no JAX).

GraniteForCausalLM (huggingface/transformers:src/transformers/models/granite/modeling_granite.py
and configuration_granite.py) is Llama with four scalars:
- `embedding_multiplier`: the token embeddings times it (`GraniteModel.forward`);
- `residual_multiplier`: each sublayer's output times it before the residual add
  (`GraniteDecoderLayer`: `x + attn(...) * m`, `x + mlp(...) * m`);
- `attention_multiplier`: the attention scores' scale, in place of head_dim ** -0.5
  (`GraniteAttention.scaling`);
- `logits_scaling`: the logits divided by it (`GraniteForCausalLM.forward`).
transformers' defaults are 1.0 each (a plain Llama but for the attention scale 1.0); Granite 3.x
releases set e.g. 12, 0.22, 0.0078125 and 8 (2B). The params are Llama's.

HF `config.json` (`from_hf` / `to_hf`): architectures `GraniteForCausalLM` (or, with no
`architectures`, `model_type` "granite"), the shared fields read by Llama's reader (RoPE of any
type `models.rope` implements; `attention_bias` / `mlp_bias` true refused, as no release has
them). transformers' GraniteConfig has no `head_dim` field: it is written only when it is not
hidden_size / num_heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import as_floats
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama

ARCHITECTURE = "GraniteForCausalLM"
MODEL_TYPE = "granite"
MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)


@dataclasses.dataclass(frozen=True)
class GraniteConfig(llama.LlamaConfig):
    """Granite: LlamaConfig's fields plus the four scalars of the module docstring (positive
    floats)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        as_floats(self, MULTIPLIERS)

    @property
    def family(self) -> str:
        return "granite"


def from_hf(d: Mapping[str, Any], source: str) -> GraniteConfig:
    """A GraniteConfig from an HF `config.json` dict; `source` names the file in errors."""
    cfg = llama.from_hf(d, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    scalars = {}
    for key in MULTIPLIERS:
        v = d.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1e300:
            raise ConfigError(f"{source}: {key} must be a positive number, found {v!r:.60}")
        scalars[key] = float(v)
    return GraniteConfig(**fields, **scalars)


def to_hf(cfg: GraniteConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a GraniteForCausalLM."""
    d = llama.to_hf(cfg) | {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
    if cfg.head_dim * cfg.num_heads == cfg.hidden_size:
        del d["head_dim"]
    return d | {key: getattr(cfg, key) for key in MULTIPLIERS}


def rule_variables(cfg: GraniteConfig) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`, as Llama's)."""
    return llama.rule_variables(cfg)
