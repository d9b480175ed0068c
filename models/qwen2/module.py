"""Qwen2 / Qwen2.5 family in Flax linen, numerically like transformers' Qwen2ForCausalLM; its
block also serves Qwen3 (`models.qwen3.module`).

Rules from huggingface/transformers:src/transformers/models/qwen2/modeling_qwen2.py: Llama's
(`models.llama.module`: RMSNorm with fp32 statistics, half-split RoPE of the config's rope type
(`models.rope`), GQA, SwiGLU, pre-norm residual blocks, untied `lm_head` or tied
`embed.embedding.T`; the pieces are imported, not copied) with `Qwen2Attention`'s biases on
q_proj, k_proj and v_proj (o_proj has none), added before RoPE. The same `QwenBlock` builds
Qwen3 (per-head q/k RMSNorm before RoPE when `cfg.qk_norm`,
huggingface/transformers:src/transformers/models/qwen3/modeling_qwen3.py `Qwen3Attention`); a
projection has a bias when the family's table has one (`models.qwen2.params`: q, k, v;
`models.qwen3.params`: q, k, v and o with `attention_bias`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Dense, causal_attention, stacked
from hybridckpt.models.llama.module import Llama, RMSNorm, apply_rope, swiglu_residual


class QwenBlock(nn.Module):
    """One pre-norm decoder layer; `cfg` is a Qwen2Config or Qwen3Config (or any LlamaConfig
    with `qk_norm`; the biases are its table's)."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd = cfg.head_dim

        def heads(h: jax.Array, n: int, name: str) -> jax.Array:
            return Dense(dt, name=name)(h).reshape(b, s, n, hd)

        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = heads(h, cfg.num_heads, "q")
        k = heads(h, cfg.num_kv_heads, "k")
        v = heads(h, cfg.num_kv_heads, "v")
        if cfg.qk_norm:  # over head_dim, per head, before RoPE
            q = RMSNorm(cfg.rms_norm_eps, dt, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dt, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, cfg.num_heads * hd)
        x = x + Dense(dt, name="o")(attn)

        return swiglu_residual(cfg, dt, x), None


class Qwen2(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32: Llama's model with
    `QwenBlock` layers."""

    def block(self) -> nn.Module:
        return stacked(QwenBlock, self.cfg.num_layers, 2)(self.cfg, self.dtype, name="layers")
