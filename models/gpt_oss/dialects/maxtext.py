"""MaxText's GPT-OSS (AI-Hypercomputer/maxtext 0.2.5, decoder_block "gpt_oss", model
`gpt-oss-20b` resized by the overrides): names in `maxtext.rules` (per layer, unscanned names;
`layer_cycle` the scan block), the config overrides that build the same model (`overrides`),
what MaxText cannot hold (`variables` refuses) or computes differently (`notes` says). Facts and
citations: docs/maxtext.md.

MaxText fixes each layer's attention by its position (models/gpt_oss.py
`GPT_OSS_ATTENTION_PATTERN`): layer i slides (`sliding_window_size`) when i is even, attends in
full when odd, and scans the pair as one block (`inhomogeneous_layer_cycle_interval` 2, the layer
count a multiple of it). A model of other `layer_types` is refused. Every layer has the routed
MoE with biases and the clamped SwiGLU (`mlp_activations_limit`; the 1.702 of its sigmoid is
hard-coded in layers/moe.py: another `swiglu_alpha` is noted); RoPE is YaRN (another type is
refused)."""

from __future__ import annotations

from typing import Any

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.gpt_oss.config import FULL, SLIDING
from hybridckpt.models.rope import rope_type, thaw

MODEL_NAME = "gpt-oss-20b"  # a MaxText model of this decoder block (overrides resize it)
CYCLE = 2  # MaxText's GPT_OSS_ATTENTION_PATTERN: (LOCAL_SLIDING, GLOBAL)
MAXTEXT_SWIGLU_ALPHA = 1.702  # layers/moe.py: activation_fn(layer_w0 * 1.702)


def layer_cycle(cfg) -> int:
    """MaxText's `inhomogeneous_layer_cycle_interval` (2), or a ConfigError when the model's
    layers are not sliding / full alternately from layer 0 (module doc)."""
    n, kinds = cfg.num_layers, tuple(cfg.layer_types)
    want = tuple(SLIDING if i % CYCLE == 0 else FULL for i in range(n))
    if kinds != want or n % CYCLE:
        raise ConfigError(
            f"MaxText's gpt_oss decoder slides on even layers and attends in full on odd ones (an even layer "
            f"count); this model's layer_types {list(kinds)[:16]} of {n} layers are not of that form: it cannot be written"
        )
    return CYCLE


def variables(cfg) -> dict[str, Any]:
    """An expert's width; refuses what MaxText's gpt_oss block cannot hold (module doc)."""
    layer_cycle(cfg)
    if rope_type(cfg.rope_scaling) != "yarn":
        raise ConfigError(
            f"MaxText's gpt_oss decoder rotates with YaRN (rope_type yarn); this model's rope_type is "
            f"{rope_type(cfg.rope_scaling)!r}: it cannot be written"
        )
    if not cfg.attention_bias:
        raise ConfigError("MaxText's gpt_oss model has attention biases; this model has none: it cannot be written")
    return {"moe_mlp": cfg.intermediate_size}


def _yarn(cfg) -> dict[str, Any]:
    return thaw(cfg.rope_scaling) or {}


def notes(cfg) -> list[str]:
    """What MaxText will compute differently from the source (said, not refused)."""
    out = []
    if cfg.swiglu_alpha != MAXTEXT_SWIGLU_ALPHA:
        out.append(f"MaxText's gpt_oss SwiGLU hard-codes alpha {MAXTEXT_SWIGLU_ALPHA}; this model's swiglu_alpha is "
                   f"{cfg.swiglu_alpha}: MaxText will compute the experts differently")  # fmt: skip
    return out


def overrides(cfg) -> dict[str, Any]:
    """MaxText config overrides (besides `model_name=MODEL_NAME override_model_config=True`)."""
    y = _yarn(cfg)
    return {
        "decoder_block": "gpt_oss",
        "base_emb_dim": cfg.hidden_size,
        "base_num_query_heads": cfg.num_heads,
        "base_num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "base_mlp_dim": cfg.intermediate_size,
        "base_moe_mlp_dim": cfg.intermediate_size,
        "base_num_decoder_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "normalization_layer_epsilon": cfg.rms_norm_eps,
        "logits_via_embedding": bool(cfg.tie_word_embeddings),
        "sliding_window_size": cfg.sliding_window,
        "attention_bias": True,
        "attention_sink": True,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "routed_bias": True,
        "mlp_bias": True,
        "mlp_activations_limit": cfg.swiglu_limit,
        "capacity_factor": -1.0,
        "inhomogeneous_layer_cycle_interval": CYCLE,
        "rope_type": "yarn",
        "rope_max_timescale": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "original_max_position_embeddings": int(y.get("original_max_position_embeddings") or cfg.max_position_embeddings),
        "rope_factor": float(y.get("factor", 1.0)),
        "beta_fast": float(y.get("beta_fast", 32)),
        "beta_slow": float(y.get("beta_slow", 1)),
        "rope_interleave": False,
        "rope_truncate": bool(y.get("truncate", True)),
        "rope_attention_scaling": True,
    }
