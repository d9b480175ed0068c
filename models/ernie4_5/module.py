"""ERNIE 4.5 dense in Flax linen, numerically like transformers' Ernie4_5ForCausalLM; its attention
also serves the MoE models (`models.ernie4_5_moe.module`).

Rules from huggingface/transformers:src/transformers/models/ernie4_5/modeling_ernie4_5.py (5.24):
Llama's pre-norm block (`models.llama.module`: RMSNorm, GQA, SwiGLU, tied or untied head) with
- `apply_rotary_pos_emb`: cos/sin `[seq, head_dim]` (angles repeated over halves, fp32) taken
  at their first half and repeated per pair; q and k turned in fp32 as
  `x * cos + rotate_half(x) * sin` with `rotate_half(x)` = interleave(-x_odd, x_even), cast back;
  with `cfg.interleaved_rope` false (a test) Llama's half-split RoPE instead;
- every projection with a bias when the table has one (`use_bias`: q, k, v, o, gate, up, down).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Dense, causal_attention, stacked
from hybridckpt.models.llama.module import Llama, RMSNorm, apply_rope, swiglu_residual


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[b, s, heads, hd]`; cos/sin `[s, hd]` fp32 (halves repeated): pair (x_2i, x_2i+1) turned
    by frequency i, in fp32, cast back to x's dtype."""
    half = x.shape[-1] // 2
    cos = jnp.repeat(cos[:, :half], 2, axis=-1)[None, :, None, :]
    sin = jnp.repeat(sin[:, :half], 2, axis=-1)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.stack([-x32[..., 1::2], x32[..., 0::2]], axis=-1).reshape(x.shape)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(cfg: Any, dt: Any, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`x + o(attn(attn_norm(x)))` with interleaved RoPE (called inside a compact module: the
    params are its own)."""
    b, s, _ = x.shape
    hd, H, KV = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
    q = Dense(dt, name="q")(h).reshape(b, s, H, hd)
    k = Dense(dt, name="k")(h).reshape(b, s, KV, hd)
    v = Dense(dt, name="v")(h).reshape(b, s, KV, hd)
    rope = apply_rope_interleaved if cfg.interleaved_rope else apply_rope
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, H * hd)
    return x + Dense(dt, name="o")(attn)


class ErnieBlock(nn.Module):
    """One pre-norm layer: the attention above, then Llama's SwiGLU (with its biases)."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        x = attention(self.cfg, self.dtype, x, cos, sin)
        return swiglu_residual(self.cfg, self.dtype, x), None


class Ernie45(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: Ernie45Config)."""

    def block(self) -> nn.Module:
        return stacked(ErnieBlock, self.cfg.num_layers, 2)(self.cfg, self.dtype, name="layers")
