"""MaxText's DeepSeek V3.2 (AI-Hypercomputer/maxtext 0.2.5, decoder_block "deepseek", model
`deepseek3.2-671b` resized by the overrides): names in `maxtext.rules` (two scanned stacks,
`decoder.dense_layers` and `decoder.moe_layers`), the config overrides that build the same model
(`overrides`), what MaxText cannot hold (`variables` refuses) or computes differently (`notes`
says). Facts and citations: docs/maxtext.md.

What MaxText's deepseek block computes (models/deepseek.py, layers/attention_mla.py, layers/moe.py,
layers/embeddings.py `YarnRotaryEmbedding`), against transformers 5.24's DeepseekV32:
- MLA and the indexer rotate with one YaRN embedding (`rope_factor`, `original_max_position_
  embeddings`, `beta_fast`, `beta_slow`, `rope_truncate`), interleaved for MLA and half-split for
  the indexer (attention_mla.py: a copy with `interleave = False`), as HF's;
- the softmax scale is qk_head_dim**-0.5 times (0.1 * mscale * ln(rope_factor) + 1)**2 when
  `max_position_embeddings > original_max_position_embeddings`: HF's `mscale_all_dim` is
  MaxText's `mscale`; HF's cos/sin factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)
  has no MaxText counterpart with `rope_attention_scaling: false` (noted when it is not 1);
- routing: sigmoid scores plus the `gate.bias` pick the top groups (`n_routing_groups`,
  `topk_routing_group`, each group scored by its top-2 sum) and the top k, the weights divided by
  their sum and times `routed_scaling_factor` (`deepseek_scale_weights`): HF's norm_topk_prob
  true (noted when false);
- no RoPE but YaRN (a model without it is refused: MaxText's deepseek configs all rotate with
  YaRN, the plain branch is not DeepSeek's), no MTP modules in the params of load_parameters_path
  (a checkpoint carrying them is refused).
"""

from __future__ import annotations

import math
from typing import Any

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.rope import rope_type, thaw

MODEL_NAME = "deepseek3.2-671b"  # a MaxText model of this decoder block (overrides resize it)
# names whose layer axis stays first when scanned: the router's bias is a MoEBiasVar, stacked on
# axis 0 by MaxText's scan (layers/nnx_decoders.py), not on param_scan_axis
LAYER_AXIS_0 = ("DeepSeekMoeBlock_0.MoeBlock_0.gate.bias",)
# MaxText's optimizer state for DeepSeek is not written: its AdamW runs over nnx.Param only (no
# moments for the router bias, a MoEBiasVar that a train save keeps under `nnx_aux`), which this
# writer's Linen opt_state layout does not express and MaxText 0.2.5 has not checked
WEIGHTS_ONLY = (
    "MaxText's DeepSeek train state keeps the router bias (a MoEBiasVar) under nnx_aux with no Adam moments; "
    "only the weights are written for deepseek_v32 (export without --optimizer)"
)


def _yarn(cfg) -> dict[str, Any]:
    return thaw(cfg.rope_scaling) or {}


def _mscale(factor: float, m: float) -> float:
    """transformers' `get_mscale` (and MaxText's formula when it applies)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def variables(cfg) -> dict[str, Any]:
    """The MLA head widths the rules split by; refuses what MaxText's deepseek block cannot hold
    (module doc)."""
    if rope_type(cfg.rope_scaling) != "yarn":
        raise ConfigError(
            f"MaxText's deepseek decoder rotates with YaRN (rope_type yarn); this model's rope_type is "
            f"{rope_type(cfg.rope_scaling)!r}: it cannot be written"
        )
    if cfg.mtp_layers:
        raise ConfigError(
            f"MaxText's load_parameters_path restores the decoder only; this checkpoint carries {cfg.mtp_layers} MTP "
            "module(s) (model.layers.<num_hidden_layers + i>), which it has no names for: it cannot be written"
        )
    if cfg.n_group > 1 and cfg.n_routed_experts % cfg.n_group:
        raise ConfigError(f"n_routed_experts {cfg.n_routed_experts} is not a multiple of n_group {cfg.n_group}")
    return {
        "kv_b_head": cfg.qk_nope_head_dim + cfg.v_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
    }


def notes(cfg) -> list[str]:
    """What MaxText will compute differently from the source (said, not refused)."""
    out = []
    y = _yarn(cfg)
    factor = float(y.get("factor", 1.0))
    m_all = float(y.get("mscale_all_dim") or 0.0)
    cos_sin = _cos_sin_factor(y, factor)
    if cos_sin != 1.0:
        out.append(
            f"HF scales YaRN's cos/sin by attention_factor {cos_sin:.6g} (transformers' _compute_yarn_parameters: "
            "mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor) without both); MaxText's "
            "(rope_attention_scaling false) does not: MaxText will rotate positions differently"
        )
    orig = _original(cfg)
    if m_all and (factor > 1) != (cfg.max_position_embeddings > orig):
        out.append(
            f"MaxText scales the softmax by YaRN's mscale when max_position_embeddings ({cfg.max_position_embeddings}) "
            f"> original_max_position_embeddings ({orig}), HF when factor ({factor}) > 1: they disagree here"
        )
    if not cfg.norm_topk_prob:
        out.append("MaxText's deepseek routing divides the top-k sigmoid weights by their sum (HF's norm_topk_prob "
                   "true); this model has norm_topk_prob false: MaxText will weight the experts differently")  # fmt: skip
    return out


def _cos_sin_factor(y: dict[str, Any], factor: float) -> float:
    """HF's YaRN `attention_factor` (transformers 5.24 `_compute_yarn_parameters`)."""
    if y.get("attention_factor") is not None:
        return float(y["attention_factor"])
    m, m_all = y.get("mscale"), y.get("mscale_all_dim")
    if m and m_all:
        return _mscale(factor, float(m)) / _mscale(factor, float(m_all))
    return _mscale(factor, 1.0)


def _original(cfg) -> int:
    y = _yarn(cfg)
    return int(y.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def overrides(cfg) -> dict[str, Any]:
    """MaxText config overrides (besides `model_name=MODEL_NAME override_model_config=True`)."""
    y = _yarn(cfg)
    groups = cfg.n_group > 1
    return {
        "decoder_block": "deepseek",
        "base_emb_dim": cfg.hidden_size,
        "base_num_query_heads": cfg.num_heads,
        "base_num_kv_heads": cfg.num_heads,
        "base_mlp_dim": cfg.intermediate_size,
        "base_moe_mlp_dim": cfg.moe_intermediate_size,
        "base_num_decoder_layers": cfg.num_layers,
        "first_num_dense_layers": cfg.num_dense_layers,
        "vocab_size": cfg.vocab_size,
        "normalization_layer_epsilon": cfg.rms_norm_eps,
        "logits_via_embedding": bool(cfg.tie_word_embeddings),
        "num_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "shared_experts": cfg.n_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "routed_score_func": "sigmoid",
        "routed_bias": True,
        "n_routing_groups": cfg.n_group if groups else -1,
        "topk_routing_group": cfg.topk_group if groups else -1,
        "attention_type": "mla",
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_type": "yarn",
        "rope_max_timescale": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "original_max_position_embeddings": _original(cfg),
        "rope_factor": float(y.get("factor", 1.0)),
        "beta_fast": float(y.get("beta_fast", 32)),
        "beta_slow": float(y.get("beta_slow", 1)),
        "mscale": float(y.get("mscale_all_dim") or 0.0),
        "rope_interleave": True,
        "rope_truncate": bool(y.get("truncate", True)),
        "rope_attention_scaling": False,
        "use_indexer": True,
        "indexer_n_heads": cfg.index_n_heads,
        "indexer_head_dim": cfg.index_head_dim,
        "indexer_topk": cfg.index_topk,
        "mtp_num_layers": 0,
    }
