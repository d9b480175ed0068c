"""Qwen3-MoE in Flax linen, numerically like transformers' Qwen3MoeForCausalLM: the MoE module
of `models.mixtral.module` built from a `Qwen3MoeConfig`, whose options select per-head q/k
RMSNorm before RoPE, `norm_topk_prob` renormalisation, routing weights cast to the hidden dtype
and dense SwiGLU layers where `mlp_only_layers` / `decoder_sparse_step` say
(huggingface/transformers:src/transformers/models/qwen3_moe/modeling_qwen3_moe.py).

Params: see `models.mixtral.module` (`layers.{q_norm,k_norm}.scale [L, head_dim]` included;
`moe.*` stacked over the MoE layers, `mlp.*` over the dense ones, in layer order).
"""

from __future__ import annotations

from hybridckpt.models.mixtral.module import Mixtral


class Qwen3Moe(Mixtral):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: Qwen3MoeConfig)."""
