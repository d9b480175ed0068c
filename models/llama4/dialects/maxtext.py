"""MaxText's Llama 4 (AI-Hypercomputer/maxtext 0.2.5, decoder_block "llama4", model
`llama4-17b-16e` resized by the overrides): names in `maxtext.rules` (per layer, unscanned names;
`layer_cycle` is the scan block), the config overrides that build the same model (`overrides`),
what MaxText cannot hold (`variables` refuses) or computes differently (`notes` says). Facts and
citations: docs/maxtext.md.

MaxText derives each layer's kind from three integers (models/llama4.py):
- MoE layer: `(i + 1) % interleave_moe_layer_step == 0` (`determine_is_moe_layer`), and the
  config requires `num_layers % interleave_moe_layer_step == 0` (configs/types.py); top-1
  routing only (sigmoid of the chosen logit scaling the expert's input), `capacity_factor -1`;
- NoPE layer: `(i + 1) % nope_layer_interval == 0` (`determine_is_nope_layer`; -1: none), which
  also picks the attention: GLOBAL on NoPE layers, CHUNK (`chunk_attn_window_size`) on RoPE ones;
- the scan block `inhomogeneous_layer_cycle_interval`: the least common multiple of the two.
A model whose `moe_layers`, `no_rope_layers` or `layer_types` are not of that form, or routes to
more than one expert, is refused (no MaxText config builds it). Constants MaxText hard-codes are
noted, not refused (the weights are right): the temperature tuning's scale 0.1 and floor 8192
(models/llama4.py passes them to Attention), the Llama 3.1 RoPE scaling (factor 8, low 1, high 4,
original context 8192: layers/embeddings.py `LLaMARotaryEmbedding._apply_scaling_factor`; or
none, `rope_use_scale: false`)."""

from __future__ import annotations

import math
from typing import Any

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama.dialects.maxtext import MAXTEXT_LLAMA3_SCALING

MODEL_NAME = "llama4-17b-16e"  # a MaxText model of this decoder block (overrides resize it)
TEMPERATURE_SCALE, TEMPERATURE_FLOOR = 0.1, 8192  # models/llama4.py: Attention(temperature_tuning_scale=0.1, ..._floor_scale=8192.0)


def _pattern(n: int, step: int) -> tuple[int, ...]:
    """The layers i < n with (i + 1) % step == 0 (MaxText's `determine_is_*_layer`)."""
    return tuple(i for i in range(n) if (i + 1) % step == 0)


def moe_step(cfg) -> int:
    """MaxText's `interleave_moe_layer_step` for `cfg`'s MoE layers, or a ConfigError."""
    n, moe = cfg.num_layers, tuple(cfg.moe_layers)
    step = moe[0] + 1 if moe else 0
    if not moe or moe != _pattern(n, step) or n % step:
        raise ConfigError(
            f"MaxText's llama4 decoder puts a mixture of experts on every interleave_moe_layer_step-th layer "
            f"(layers i with (i + 1) % step == 0, the layer count a multiple of the step); this model's MoE layers "
            f"{list(moe)[:16]} of {n} are not of that form: it cannot be written"
        )
    return step


def nope_interval(cfg) -> int:
    """MaxText's `nope_layer_interval` for `cfg`'s NoPE layers (-1: none), or a ConfigError."""
    n = cfg.num_layers
    nope = tuple(i for i, rope in enumerate(cfg.rope_layers) if not rope)
    if not nope:
        return -1
    interval = nope[0] + 1
    if nope != _pattern(n, interval):
        raise ConfigError(
            f"MaxText's llama4 decoder makes every nope_layer_interval-th layer NoPE (layers i with (i + 1) % "
            f"interval == 0); this model's NoPE layers {list(nope)[:16]} of {n} are not of that form: it cannot be written"
        )
    return interval


def layer_cycle(cfg) -> int:
    """MaxText's `inhomogeneous_layer_cycle_interval`: the scan block (lcm of the MoE step and the
    NoPE interval)."""
    interval = nope_interval(cfg)
    return math.lcm(moe_step(cfg), interval if interval > 0 else 1)


def variables(cfg) -> dict[str, Any]:
    """No rule variables; refuses what MaxText's llama4 block cannot hold (module doc)."""
    layer_cycle(cfg)
    if cfg.num_experts_per_tok != 1:
        raise ConfigError(
            f"MaxText's llama4 decoder routes each token to one expert (configs/types.py: 'Only top-1 routing is "
            f"supported for Llama4'); this model has num_experts_per_tok {cfg.num_experts_per_tok}: it cannot be written"
        )
    want = tuple(rope for rope in cfg.rope_layers)
    if tuple(cfg.chunked_layers) != want and cfg.attention_chunk_size is not None:
        raise ConfigError(
            f"MaxText's llama4 decoder gives chunked attention to exactly the RoPE layers and global attention to the "
            f"NoPE ones; this model's layer_types {list(cfg.layer_types)[:16]} differ: it cannot be written"
        )
    return {}


def _rope_scaling(cfg) -> dict:
    return dict(getattr(cfg, "rope_scaling", None) or {})


def _llama3_rope(cfg) -> bool:
    rs = _rope_scaling(cfg)
    return (rs.get("rope_type") or rs.get("type")) == "llama3"


def notes(cfg) -> list[str]:
    """What MaxText will compute differently from the source (said, not refused)."""
    out = []
    rs = _rope_scaling(cfg)
    kind = rs.get("rope_type") or rs.get("type")
    if _llama3_rope(cfg):
        off = {k: rs.get(k) for k, v in MAXTEXT_LLAMA3_SCALING.items() if rs.get(k) != v}
        if off:
            out.append(
                f"MaxText's llama4 RoPE (rope_type llama3.1) hard-codes the scaling {MAXTEXT_LLAMA3_SCALING}; this "
                f"model has {', '.join(f'{k}={v}' for k, v in off.items())}: MaxText will rotate positions differently"
            )
    elif kind not in (None, "default"):
        out.append(f"MaxText's llama4 RoPE has no {kind!r} scaling (written with rope_use_scale=false): MaxText will "
                   "rotate positions differently")  # fmt: skip
    if cfg.attn_temperature_tuning and (cfg.attn_scale, cfg.floor_scale) != (TEMPERATURE_SCALE, TEMPERATURE_FLOOR):
        out.append(
            f"MaxText's llama4 attention temperature tuning hard-codes scale {TEMPERATURE_SCALE} and floor "
            f"{TEMPERATURE_FLOOR} (models/llama4.py); this model has attn_scale {cfg.attn_scale}, floor_scale "
            f"{cfg.floor_scale}: MaxText will scale the NoPE layers' queries differently"
        )
    if cfg.attention_chunk_size is None:
        out.append(
            f"this model has no attention_chunk_size (full attention); MaxText's llama4 RoPE layers always chunk: "
            f"chunk_attn_window_size is set to max_position_embeddings ({cfg.max_position_embeddings}), full "
            "attention on sequences up to that length"
        )
    return out


def overrides(cfg) -> dict[str, Any]:
    """MaxText config overrides (besides `model_name=MODEL_NAME override_model_config=True`)."""
    interval = nope_interval(cfg)
    return {
        "decoder_block": "llama4",
        "base_emb_dim": cfg.hidden_size,
        "base_num_query_heads": cfg.num_heads,
        "base_num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        # the dense layers' width; a fully-MoE model: MaxText wants it equal to the experts'
        "base_mlp_dim": cfg.intermediate_size_mlp if cfg.dense_layers else cfg.intermediate_size,
        "base_moe_mlp_dim": cfg.intermediate_size,
        "base_num_decoder_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "normalization_layer_epsilon": cfg.rms_norm_eps,
        "rope_max_timescale": cfg.rope_theta,
        "rope_type": "llama3.1",  # interleaved-pair rotary, as HF Llama 4
        "rope_use_scale": _llama3_rope(cfg),
        "logits_via_embedding": bool(cfg.tie_word_embeddings),
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "shared_experts": 1,
        "capacity_factor": -1.0,  # dropless (MaxText refuses anything else for llama4)
        "use_qk_norm": bool(cfg.use_qk_norm),
        "nope_layer_interval": interval,
        "interleave_moe_layer_step": moe_step(cfg),
        "inhomogeneous_layer_cycle_interval": layer_cycle(cfg),
        "temperature_tuning": bool(cfg.attn_temperature_tuning),
        "chunk_attn_window_size": cfg.attention_chunk_size or cfg.max_position_embeddings,
    }
