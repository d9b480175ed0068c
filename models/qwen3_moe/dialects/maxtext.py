"""MaxText's Qwen3-MoE (AI-Hypercomputer/maxtext 0.2.5, decoder_block "qwen3_moe"): Qwen3's names
(`models/qwen3/dialects/maxtext.rules`) plus the routed experts (`maxtext.rules` here), the config
overrides for a model (`overrides`), what MaxText cannot express (`variables` refuses, `notes`
says). Facts and citations: docs/maxtext.md.

MaxText's Qwen3MoeDecoderLayer (models/qwen3.py) has a RoutedMoE in EVERY layer (no dense
layers: a config with `mlp_only_layers` or `decoder_sparse_step` > 1 is refused), no shared
expert, no router bias (`routed_bias` false). Its routing (layers/moe.py `RoutedMoE.get_topk`)
takes the top k of the router logits and softmaxes THOSE: the top-k probabilities always sum to
one, which is HF's `norm_topk_prob: true`; a model trained with `norm_topk_prob: false` (HF's
softmax over every expert, top k not renormalized) is written (the weights are right) with a note.
Dropless: MaxText's default `capacity_factor: -1` drops no token (sparse or dense matmul)."""

from __future__ import annotations

from typing import Any

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen3.dialects import maxtext as qwen3

MODEL_NAME = "qwen3-30b-a3b"  # a MaxText model of this decoder block (overrides resize it)
RULES = (
    "hybridckpt.models.qwen3.dialects:maxtext.rules",
    "hybridckpt.models.qwen3_moe.dialects:maxtext.rules",
)


def variables(cfg) -> dict[str, Any]:
    """No rule variables; refuses what MaxText's qwen3_moe block cannot hold."""
    qwen3.variables(cfg)
    dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
    if dense:
        raise ConfigError(
            f"MaxText's qwen3_moe decoder has a mixture of experts in every layer; this model's layers "
            f"{dense} are dense (mlp_only_layers {list(cfg.mlp_only_layers)}, decoder_sparse_step "
            f"{cfg.decoder_sparse_step}): it cannot be written"
        )
    return {}


def notes(cfg) -> list[str]:
    """What MaxText will compute differently from the source (said, not refused)."""
    out = []
    if not cfg.norm_topk_prob:
        out.append(
            "MaxText's qwen3_moe routing softmaxes the top-k router logits (the k weights sum to 1, "
            "HF's norm_topk_prob=true); this model has norm_topk_prob=false: MaxText will weight the "
            "experts differently from the source"
        )
    if cfg.sliding_window is not None:
        out.append(f"MaxText's qwen3_moe attention is global; this model windows it ({cfg.sliding_window})")
    return out


def overrides(cfg) -> dict[str, Any]:
    """MaxText config overrides (besides `model_name=MODEL_NAME override_model_config=True`)."""
    return {
        **qwen3.overrides(cfg),
        "decoder_block": "qwen3_moe",
        "base_mlp_dim": cfg.moe_intermediate_size,  # a fully-MoE model: MaxText wants mlp = moe_mlp
        "base_moe_mlp_dim": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "capacity_factor": -1.0,  # dropless (MaxText's default)
    }
