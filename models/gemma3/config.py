"""Gemma 3 text family config and its HF form (no JAX; rule variables are Gemma 2's).

HF `config.json` (`from_hf` / `to_hf`): architectures `Gemma3ForCausalLM` (or, when
`architectures` is absent, `model_type` "gemma3_text"), read as
huggingface/transformers:src/transformers/models/gemma3/configuration_gemma3.py
(`Gemma3TextConfig`) reads it. What differs from Gemma 2 (`models.gemma2.config`, whose readers
this reuses):
- `layer_types` default: layer i slides iff (i + 1) % `sliding_window_pattern` (default 6), so
  5 local layers, then 1 global.
- Two RoPE parameter sets: transformers 5's `rope_parameters` nested by layer type
  (`{"full_attention": {...}, "sliding_attention": {...}}`), or v4's `rope_theta` (global,
  default 1e6) + `rope_scaling` (global layers only) + `rope_local_base_freq` (local, default
  1e4). Each is read and written back unchanged by `models.rope` (both forms are written).
- Per-head q/k RMSNorm (no config key); `final_logit_softcapping` defaults to null.
- `attn_logit_softcapping` is kept for the round trip but never applied: transformers'
  `Gemma3Attention` does not pass it to the attention (so Gemma 3 has no attention soft-cap).

Only the text model: `Gemma3ForConditionalGeneration` (vision + `text_config`) is not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.models.config_checks import as_floats
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.gemma2.config import (
    FULL,
    SLIDING,
    check_gemma,
    check_hf_gemma,
    hf_common,
    hf_layer_types,
    hf_sizes,
)
from hybridckpt.models.rope import Scaling, check_config_rope, read_hf_rope, rope_parameters, thaw

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
DEFAULT_PATTERN = 6  # sliding_window_pattern: 5 local layers, then 1 global


@dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3 text (Gemma3ForCausalLM). Like `Gemma2Config`, with two RoPEs (each a theta and
    a `models.rope.Scaling`, None for plain RoPE): `rope_theta` / `rope_scaling` for the global
    ("full_attention") layers, `rope_local_base_freq` / `rope_local_scaling` for the local
    ("sliding_attention") ones.

    layer_types: () means transformers' rule with sliding_window_pattern 6 (resolved at
    construction).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = 4096
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float | None = None  # kept, never applied (as in transformers)
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Scaling | None = None
    rope_local_base_freq: float = 10_000.0
    rope_local_scaling: Scaling | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131_072

    def __post_init__(self) -> None:
        kinds = self.layer_types
        if isinstance(kinds, list):
            kinds = tuple(kinds)
        if kinds == () and isinstance(self.num_layers, int):
            kinds = hf_layer_types({}, self.num_layers, DEFAULT_PATTERN)
        object.__setattr__(self, "layer_types", kinds)
        check_gemma(self)
        as_floats(self, ("rope_theta", "rope_local_base_freq"))
        for theta, field in (
            ("rope_theta", "rope_scaling"),
            ("rope_local_base_freq", "rope_local_scaling"),
        ):
            scaling = check_config_rope(getattr(self, theta), getattr(self, field), "Gemma3Config")
            object.__setattr__(self, field, scaling)

    @property
    def family(self) -> str:
        return "gemma3"

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: True for a local (sliding-window) layer, False for a global one."""
        return tuple(kind == SLIDING for kind in self.layer_types)


# ---------------------------------------------------------------------------------------- HF


def _hf_ropes(d: Mapping[str, Any], source: str) -> list[tuple[float, Scaling | None]]:
    """[(theta, scaling) of global layers, same of local layers], as
    `Gemma3TextConfig.convert_rope_params_to_dict` builds them: the nested `rope_parameters`,
    v4's `rope_scaling` over the global dict, then the thetas from `rope_theta` /
    `rope_local_base_freq` (1e6 / 1e4) where the dicts give none. A given `rope_scaling` is
    kept as written (plus any keys only the nested dict has), so it comes back unchanged."""
    nested = d.get("rope_parameters") or {}
    if not isinstance(nested, Mapping) or not set(nested) <= {FULL, SLIDING}:
        raise ConfigError(
            f"{source}: rope_parameters must be an object keyed by {FULL!r} and {SLIDING!r}, "
            f"found {nested!r}"
        )
    ropes = []
    for kind, theta_key, default_theta in (
        (FULL, "rope_theta", 1_000_000.0),
        (SLIDING, "rope_local_base_freq", 10_000.0),
    ):
        rope = nested.get(kind) or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: rope_parameters.{kind} must be an object, found {rope!r}")
        scaling = d.get("rope_scaling") if kind == FULL else None
        if scaling is not None and not isinstance(scaling, Mapping):
            raise ConfigError(
                f"{source}: rope_scaling must be an object or null, found {scaling!r}"
            )
        theta = rope.get("rope_theta")
        if scaling:  # transformers merges it over the nested dict; we keep it as written
            extra = {k: v for k, v in rope.items() if k not in scaling and k != "rope_theta"}
            rope = {**scaling, **extra}
        theta = d.get(theta_key) if theta is None else theta
        one = {"rope_parameters": rope, "rope_theta": default_theta if theta is None else theta}
        ropes.append(read_hf_rope(one, f"{source}: rope_parameters.{kind}"))
    return ropes


def from_hf(d: Mapping[str, Any], source: str) -> Gemma3Config:
    """A Gemma3Config from an HF `config.json` dict; `source` names the file in errors."""
    check_hf_gemma(d, source, ARCHITECTURE)
    sizes = hf_sizes(d)
    pattern = d.get("sliding_window_pattern") or DEFAULT_PATTERN
    (theta, scaling), (local_theta, local_scaling) = _hf_ropes(d, source)
    return Gemma3Config(
        **sizes,
        layer_types=hf_layer_types(d, sizes["num_layers"], pattern),
        sliding_window=d.get("sliding_window", 4096),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_base_freq=local_theta,
        rope_local_scaling=local_scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        max_position_embeddings=d.get("max_position_embeddings", 131_072),
    )


def _pattern(layer_types: tuple[str, ...]) -> int | None:
    """The sliding_window_pattern that gives `layer_types` by transformers' rule, if one does."""
    n = len(layer_types)
    for p in range(1, n + 2):
        if hf_layer_types({}, n, p) == layer_types:
            return p
    return None


def to_hf(cfg: Gemma3Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back: v5's nested `rope_parameters` and v4's
    `rope_theta`, `rope_scaling`, `rope_local_base_freq` (and `sliding_window_pattern` when the
    layer kinds follow one)."""
    max_pos = cfg.max_position_embeddings
    out = {
        **hf_common(cfg, ARCHITECTURE, MODEL_TYPE),
        "rope_theta": cfg.rope_theta,
        "rope_scaling": thaw(cfg.rope_scaling),
        "rope_local_base_freq": cfg.rope_local_base_freq,
        "rope_parameters": {
            FULL: rope_parameters(cfg.rope_theta, cfg.rope_scaling, max_pos),
            SLIDING: rope_parameters(cfg.rope_local_base_freq, cfg.rope_local_scaling, max_pos),
        },
    }
    pattern = _pattern(cfg.layer_types)
    if pattern is not None:
        out["sliding_window_pattern"] = pattern
    return out
