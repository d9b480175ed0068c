"""MaxText's Llama (AI-Hypercomputer/maxtext 0.2.5, decoder_block "llama2"; Mistral shares it):
names and layouts in `maxtext.rules` (MaxText names -> HF names; the writer inverts them), the
config facts MaxText needs (`variables`) and the overrides that make MaxText build the same model
(`overrides`). Facts and citations: docs/maxtext.md. Reader and writer: formats/maxtext/layout.py,
formats/maxtext/write.py."""

from __future__ import annotations

from typing import Any

MODEL_NAME = "llama2-7b"  # a MaxText model whose decoder block is this family's (overrides resize it)
# Llama 3.x rope scaling MaxText can express: LLaMARotaryEmbedding._apply_scaling_factor hard-codes
# factor 8, low_freq_factor 1, high_freq_factor 4, old_context_len 8192 (layers/embeddings.py).
MAXTEXT_LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}


def _rope_scaling(cfg) -> dict:
    return dict(getattr(cfg, "rope_scaling", None) or {})


def llama3_rope(cfg) -> bool:
    """Whether the config's RoPE is Llama 3.x's scaled one (MaxText's rope_type "llama3.1")."""
    rs = _rope_scaling(cfg)
    return (rs.get("rope_type") or rs.get("type")) == "llama3"


def variables(cfg) -> dict[str, Any]:
    """Rule variables beyond the family's: `maxtext_interleaved_rope` (q/k rows in MaxText's
    interleaved RoPE order: its llama3.1 rotary; the default rotary is half-split, as HF)."""
    return {"maxtext_interleaved_rope": llama3_rope(cfg)}


def notes(cfg) -> list[str]:
    """What MaxText cannot express of `cfg` (said, not refused: the weights are right)."""
    if not llama3_rope(cfg):
        return []
    rs = _rope_scaling(cfg)
    off = {k: (rs.get(k), v) for k, v in MAXTEXT_LLAMA3_SCALING.items() if rs.get(k) != v}
    if not off:
        return []
    return [
        "MaxText's llama3.1 RoPE hard-codes the scaling "
        f"{MAXTEXT_LLAMA3_SCALING}; this model has {', '.join(f'{k}={a}' for k, (a, _) in off.items())}: "
        "MaxText will rotate positions differently from the source"
    ]


def overrides(cfg) -> dict[str, Any]:
    """MaxText config overrides (besides `model_name=MODEL_NAME override_model_config=True`) for
    the model of `cfg`."""
    out = {
        "base_emb_dim": cfg.hidden_size,
        "base_num_query_heads": cfg.num_heads,
        "base_num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "base_mlp_dim": cfg.intermediate_size,
        "base_num_decoder_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "normalization_layer_epsilon": cfg.rms_norm_eps,
        "rope_max_timescale": cfg.rope_theta,
        "logits_via_embedding": bool(getattr(cfg, "tie_word_embeddings", False)),
        "decoder_block": "llama2",
    }
    if llama3_rope(cfg):
        out["rope_type"] = "llama3.1"
    return out
