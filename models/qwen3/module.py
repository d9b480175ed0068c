"""Qwen3 (dense) family in Flax linen, numerically like transformers' Qwen3ForCausalLM.

Rules from huggingface/transformers:src/transformers/models/qwen3/modeling_qwen3.py: Qwen2's
model (`models.qwen2.module`, itself Llama's pieces) with the block options a `Qwen3Config`
gives: `q_norm` / `k_norm`, RMSNorm (fp32 statistics, eps = rms_norm_eps) over head_dim of each
head of q and k, after the projection and before RoPE (`Qwen3Attention.forward`); biases on
q, k, v and o only with `attention_bias`; head_dim explicit (q is `[embed, heads*head_dim]`,
which need not equal embed).

Params: the family's table (`models.qwen3.params`): Llama's plus layers.{q_norm,k_norm}.scale
`[L, head_dim]` and, with attention_bias, biases on q, k, v and o.
"""

from __future__ import annotations

from hybridckpt.models.qwen2.module import Qwen2


class Qwen3(Qwen2):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: Qwen3Config)."""
