"""MaxText's Qwen3-Next (AI-Hypercomputer/maxtext 0.2.5, decoder_block "qwen3_next", model
`qwen3-next-80b-a3b` resized by the overrides): names in `maxtext.rules` (per layer, unscanned
names; `scan_groups` the scanned form), the config overrides that build the same model
(`overrides`), what MaxText cannot hold (`variables` refuses) or computes differently (`notes`
says). Facts and citations: docs/maxtext.md.

MaxText derives each layer's kind from one integer, `inhomogeneous_layer_cycle_interval` c
(models/qwen3.py `Qwen3NextDecoderLayer`): layer i has full attention when
`(i % c + 1) % c == 0`, the gated delta net otherwise; scanned, a block is c - 1 delta-net
layers then the full-attention one (`Qwen3NextScannableBlock` refuses any other order) and the
layer count must be a multiple of c. Every layer has the sparse MoE with ONE sigmoid-gated
shared expert (`Qwen3NextSparseMoeBlock`; `shared_experts: 1`): a model with dense layers
(`mlp_only_layers`, `decoder_sparse_step` > 1) or layer_types of another form is refused (no
MaxText config builds it). MaxText's RoPE here is `PartialRotaryEmbedding` with no scaling: a
rope scaling is noted, not refused (the weights are right); so is `norm_topk_prob: false` (its
RoutedMoE renormalizes the top k)."""

from __future__ import annotations

from typing import Any

from hybridckpt.models.errors import ConfigError

MODEL_NAME = "qwen3-next-80b-a3b"  # a MaxText model of this decoder block (overrides resize it)


def layer_cycle(cfg) -> int:
    """MaxText's `inhomogeneous_layer_cycle_interval`: the first full-attention layer + 1, every
    layer's kind of MaxText's form (module doc), or a ConfigError."""
    n, full = cfg.num_layers, tuple(cfg.attention_layers)
    c = full[0] + 1 if full else 0
    want = tuple(i for i in range(n) if c and (i % c + 1) % c == 0)
    if c < 2 or full != want or n % c:
        raise ConfigError(
            f"MaxText's qwen3_next decoder puts full attention on the last layer of every block of "
            f"inhomogeneous_layer_cycle_interval layers (at least 2, the delta net on the others, the layer count a "
            f"multiple of it); this model's full-attention layers {list(full)[:16]} of {n} are not of that form: "
            "it cannot be written"
        )
    return c


def scan_groups(cfg) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """The scanned tree (models/qwen3.py `Qwen3NextScannableBlock`): the delta-net positions
    0..c-2 under `local_layers` (an inner scan: its own axis after the blocks'), the full-attention
    position c-1 under `global_layer` (blocks only): (name, block positions, inner axis) as
    formats/maxtext/scan_groups.py reads them."""
    c = layer_cycle(cfg)
    return (("local_layers", tuple(range(c - 1)), True), ("global_layer", (c - 1,), False))


def variables(cfg) -> dict[str, Any]:
    """The gated query's per-head width; refuses what MaxText's qwen3_next block cannot hold."""
    layer_cycle(cfg)
    dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
    if dense:
        raise ConfigError(
            f"MaxText's qwen3_next decoder has a mixture of experts in every layer; this model's layers {dense[:16]} "
            f"are dense (mlp_only_layers {list(cfg.mlp_only_layers)[:16]}, decoder_sparse_step "
            f"{cfg.decoder_sparse_step}): it cannot be written"
        )
    return {"gated_head_dim": 2 * cfg.head_dim}


def notes(cfg) -> list[str]:
    """What MaxText will compute differently from the source (said, not refused)."""
    out = []
    rs = dict(getattr(cfg, "rope_scaling", None) or {})
    kind = rs.get("rope_type") or rs.get("type")
    if kind not in (None, "default"):
        out.append(f"MaxText's qwen3_next RoPE (PartialRotaryEmbedding) has no {kind!r} scaling: MaxText will rotate "
                   "positions differently")  # fmt: skip
    if not cfg.norm_topk_prob:
        out.append(
            "MaxText's qwen3_next routing softmaxes the top-k router logits (the k weights sum to 1, HF's "
            "norm_topk_prob=true); this model has norm_topk_prob=false: MaxText will weight the experts differently"
        )
    return out


def overrides(cfg) -> dict[str, Any]:
    """MaxText config overrides (besides `model_name=MODEL_NAME override_model_config=True`)."""
    return {
        "decoder_block": "qwen3_next",
        "base_emb_dim": cfg.hidden_size,
        "base_num_query_heads": cfg.num_heads,
        "base_num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "base_mlp_dim": cfg.moe_intermediate_size,  # a fully-MoE model: MaxText wants mlp = moe_mlp
        "base_moe_mlp_dim": cfg.moe_intermediate_size,
        "base_num_decoder_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "normalization_layer_epsilon": cfg.rms_norm_eps,
        "rope_max_timescale": cfg.rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "logits_via_embedding": bool(cfg.tie_word_embeddings),
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "shared_experts": 1,
        "capacity_factor": -1.0,  # dropless (MaxText's default)
        "inhomogeneous_layer_cycle_interval": layer_cycle(cfg),
        "gdn_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "gdn_key_head_dim": cfg.linear_key_head_dim,
        "gdn_value_head_dim": cfg.linear_value_head_dim,
        "gdn_num_key_heads": cfg.linear_num_key_heads,
        "gdn_num_value_heads": cfg.linear_num_value_heads,
    }
