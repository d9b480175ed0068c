"""Gemma 3 text in Flax linen, numerically like transformers' Gemma3ForCausalLM: the Gemma 2
module (`models.gemma2.module`, whose docstring says how the alternating layers are stacked)
with three changes, from huggingface/transformers:src/transformers/models/gemma3/modeling_gemma3.py:
- q/k RMSNorm per head (`Gemma3Attention.q_norm` / `k_norm`, the (1 + w) kind, size head_dim),
  applied after the q/k projections and before RoPE.
- Two RoPE tables (`Gemma3RotaryEmbedding`, one per layer type, each of any rope type
  `models.rope` implements): global layers use `rope_theta` and `rope_scaling` (linear, factor
  8, in the 4B-27B releases), local layers `rope_local_base_freq` (and `rope_local_scaling`,
  None in every release); the per-layer kind picks the row.
- No attention soft-cap (`Gemma3Attention` never passes `attn_logit_softcapping`); the final
  logit soft-cap applies when `final_logit_softcapping` is set.

Params: Gemma 2's plus layers.{q_norm,k_norm}.scale [L, head_dim] (fp32, zero-centred).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from hybridckpt.models.gemma2.module import Gemma2
from hybridckpt.models.gemma3.config import Gemma3Config
from hybridckpt.models.rope import rope_tables


class Gemma3(Gemma2):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: Gemma3Config

    qk_norm: ClassVar[bool] = True

    def attention_softcap(self) -> float | None:
        return None

    def rope(self, seq: int) -> tuple[jax.Array, jax.Array]:
        """cos, sin `[2, seq, hd]`: row 0 of the global RoPE, row 1 of the local one."""
        cfg = self.cfg
        kw = dict(max_position_embeddings=cfg.max_position_embeddings)
        cos_g, sin_g = rope_tables(seq, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, **kw)
        cos_l, sin_l = rope_tables(
            seq, cfg.head_dim, cfg.rope_local_base_freq, cfg.rope_local_scaling, **kw
        )
        return jnp.stack([cos_g, cos_l]), jnp.stack([sin_g, sin_l])
