"""What the families' Megatron dialects (`models/<family>/dialects/megatron.py`) share, so that
each states only what is its own: the facts of a Llama-like GPTModel that their `MATCH` start
from, the facts of Megatron's default router, HF_KEYS less the values a family gives otherwise,
and the one check of a size read from Megatron's args.

What the facts mean: hybridckpt/formats/megatron/config.py. No JAX, nothing of `hybridckpt` above
`errors` (a dialect module is imported on first use).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridckpt.models.errors import FormatError

# RMSNorm, SwiGLU, RoPE: the GPTModel every family here but GPT-2 is (args `normalization`,
# `swiglu`, `position_embedding_type`)
RMSNORM_SWIGLU_ROPE = {"normalization": "RMSNorm", "swiglu": True, "position_embedding": "rope"}

# Megatron's default router (moe_utils.py `topk_routing_with_score_function`): softmax scores, no
# expert bias, no group-limited choice, no top-k scaling factor (Mixtral, Qwen3-MoE, Qwen3-Next)
SOFTMAX_ROUTER = {"sigmoid": False, "expert_bias": False, "grouped": False, "scaled": False}


def hf_keys_without(keys: Mapping[str, str], *values: str) -> dict[str, str]:
    """`keys` (a family's HF_KEYS: Megatron value -> config.json key), in order, less `values`
    (those the family gives some other way: `hf_extra`, or another value's key)."""
    return {k: v for k, v in keys.items() if k not in values}


def positive_int(value: Any, name: str, file: str) -> int:
    """`value`, the args' (or the format's value) `name` read from `file`, when it is a positive
    int (bools are not ints); else one FormatError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise FormatError(f"{file}: args.{name}={value!r:.40}: expected a positive int")
    return value
