"""OLMo 2 in Flax linen, numerically like transformers' Olmo2ForCausalLM.

Rules from huggingface/transformers:src/transformers/models/olmo2/modeling_olmo2.py: Llama's
pieces (`models.llama.module`: RMSNorm with fp32 statistics, half-split RoPE of the config's rope
type, GQA, SwiGLU, tied or untied head) in `Olmo2DecoderLayer`'s order:
  q = q_norm(q_proj(x)), k = k_norm(k_proj(x))   RMSNorm over heads * head_dim, before RoPE
  x = x + post_attention_layernorm(o_proj(attention))
  x = x + post_feedforward_layernorm(down(silu(gate(x)) * up(x)))
then the final norm and the head. `Olmo2RMSNorm` multiplies by the weight in fp32 before casting
back (Llama's casts first): the same in fp32, the dtype the logits are checked in.

The config's `post_norms` / `qk_norm_whole` (always true for the family) select this; false
(a test's switch) applies the norms before the sublayers, or per head (the weight `[Q]` seen as
`[heads, head_dim]`), to show each fact matters.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Dense, causal_attention, stacked, table_param
from hybridckpt.models.llama.module import Llama, RMSNorm, apply_rope


def _rms(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over x's last axis with fp32 statistics, the weight applied in fp32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * y).astype(x.dtype)


class WholeRMSNorm(nn.Module):
    """RMSNorm over the whole projection `[batch, seq, heads * head_dim]`; with `per_head`
    (a test's switch) over each head of `head_dim` instead, the same weight."""

    eps: float
    head_dim: int
    per_head: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = table_param(self, "scale")
        if not self.per_head:
            return _rms(x, scale, self.eps)
        b, s, n = x.shape
        heads = x.reshape(b, s, n // self.head_dim, self.head_dim)
        return _rms(heads, scale.reshape(-1, self.head_dim), self.eps).reshape(b, s, n)


class Olmo2Block(nn.Module):
    """One OLMo 2 layer (post-norms; see the module docstring)."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd, post = cfg.head_dim, cfg.post_norms
        per_head = not cfg.qk_norm_whole
        post_attn = RMSNorm(cfg.rms_norm_eps, dt, name="post_attn_norm")
        post_mlp = RMSNorm(cfg.rms_norm_eps, dt, name="post_mlp_norm")

        h = x if post else post_attn(x)
        q = WholeRMSNorm(cfg.rms_norm_eps, hd, per_head, name="q_norm")(Dense(dt, name="q")(h))
        k = WholeRMSNorm(cfg.rms_norm_eps, hd, per_head, name="k_norm")(Dense(dt, name="k")(h))
        v = Dense(dt, name="v")(h)
        q = apply_rope(q.reshape(b, s, cfg.num_heads, hd), cos, sin)
        k = apply_rope(k.reshape(b, s, cfg.num_kv_heads, hd), cos, sin)
        v = v.reshape(b, s, cfg.num_kv_heads, hd)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, cfg.num_heads * hd)
        a = Dense(dt, name="o")(attn)
        x = x + (post_attn(a) if post else a)

        h = x if post else post_mlp(x)
        m = Dense(dt, name="down")(nn.silu(Dense(dt, name="gate")(h)) * Dense(dt, name="up")(h))
        return x + (post_mlp(m) if post else m), None


class Olmo2(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32: Llama's model with
    `Olmo2Block` layers."""

    def block(self) -> nn.Module:
        return stacked(Olmo2Block, self.cfg.num_layers, 2)(self.cfg, self.dtype, name="layers")
