"""MaxText's Qwen3 (AI-Hypercomputer/maxtext 0.2.5, decoder_block "qwen3"): names in
`maxtext.rules` (no value ops: MaxText's Qwen3 attention scales the query itself and rotates
half-split), the MaxText config overrides for a model (`overrides`). Facts: docs/maxtext.md."""

from __future__ import annotations

from typing import Any

from hybridckpt.models.errors import ConfigError

MODEL_NAME = "qwen3-0.6b"  # a MaxText model of this decoder block (overrides resize it)


def variables(cfg) -> dict[str, Any]:
    if getattr(cfg, "attention_bias", False):
        raise ConfigError("MaxText's qwen3 decoder has no q/k/v biases: a Qwen3 with attention_bias cannot be written")
    return {}


def overrides(cfg) -> dict[str, Any]:
    """MaxText config overrides (besides `model_name=MODEL_NAME override_model_config=True`)."""
    return {
        "base_emb_dim": cfg.hidden_size,
        "base_num_query_heads": cfg.num_heads,
        "base_num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "base_mlp_dim": cfg.intermediate_size,
        "base_num_decoder_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "normalization_layer_epsilon": cfg.rms_norm_eps,
        "rope_max_timescale": cfg.rope_theta,
        "logits_via_embedding": bool(cfg.tie_word_embeddings),
        "normalize_embedding_logits": False,
        "use_qk_norm": True,
        "decoder_block": "qwen3",
    }
