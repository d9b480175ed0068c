"""Llama family in Flax linen, numerically like transformers' LlamaForCausalLM.

Rules from huggingface/transformers:src/transformers/models/llama/modeling_llama.py:
- RMSNorm: x fp32 * rsqrt(mean(x^2) + eps), cast back to the compute dtype, times scale.
- RoPE, half-split convention: inv_freq of the config's rope type (`models.rope`: default
  theta ** -(arange(0, hd, 2) / hd), linear, dynamic, llama3, yarn); angles = position *
  inv_freq in fp32, repeated over both halves; cos and sin times the type's attention scaling,
  cast to the compute dtype; x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1).
- GQA: kv head j serves q heads j*rep .. (j+1)*rep - 1 (`repeat_kv`).
- SwiGLU MLP: down(silu(gate(x)) * up(x)). Pre-norm residual blocks; untied `lm_head` or tied
  `embed.embedding.T`.
- Attention mask: causal; `Llama.sliding_window()` (None here) is the hook a family built on
  this module overrides to mask keys `window` or more positions back (Mistral).

Params: the family's table (`models.llama.params`; fp32, kernels `[in, out]`, per-layer params
stacked on a leading `[L]` axis), created by name from it (`models.common.table_param`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import (
    Dense,
    Embed,
    causal_attention,
    output_logits,
    stacked,
    table_param,
)
from hybridckpt.models.llama.config import LlamaConfig
from hybridckpt.models.rope import config_rope_tables
from hybridckpt.models.rope import rope_tables as _scaled_rope_tables


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = table_param(self, "scale")
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * scale.astype(self.dtype)


def rope_tables(
    seq: int, head_dim: int, theta: float, scaling: Any = None, **kwargs: Any
) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[seq, head_dim]` fp32 for positions 0..seq-1 (angles repeated over halves).

    Kept for the families that import it from here: `models.rope.rope_tables` (scaling and
    `max_position_embeddings` as there; `models.rope.config_rope_tables(cfg, seq)` reads them
    from a config)."""
    return _scaled_rope_tables(seq, head_dim, theta, scaling, **kwargs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[batch, seq, heads, hd]`; cos/sin `[seq, hd]`, or `[batch, seq, hd]` where positions
    differ per sequence (Qwen-VL's M-RoPE), cast to x's dtype (as HF does)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def swiglu_residual(cfg: Any, dt: Any, x: jax.Array) -> jax.Array:
    """`x + down(silu(gate(n)) * up(n))` with `n = mlp_norm(x)`: the second half of every
    Llama-like block (called inside a compact module: the params are its own)."""
    h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
    gate = Dense(dt, name="gate")(h)
    up = Dense(dt, name="up")(h)
    return x + Dense(dt, name="down")(nn.silu(gate) * up)


class LlamaBlock(nn.Module):
    """One pre-norm block; `sliding_window` (None: plain causal) masks keys that far back."""

    cfg: LlamaConfig
    dtype: Any
    sliding_window: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd = cfg.head_dim

        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = Dense(dt, name="q")(h)
        k = Dense(dt, name="k")(h)
        v = Dense(dt, name="v")(h)
        q = apply_rope(q.reshape(b, s, cfg.num_heads, hd), cos, sin)
        k = apply_rope(k.reshape(b, s, cfg.num_kv_heads, hd), cos, sin)
        v = v.reshape(b, s, cfg.num_kv_heads, hd)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        attn = causal_attention(q, k, v, hd**-0.5, window=self.sliding_window)
        attn = attn.reshape(b, s, cfg.num_heads * hd)
        x = x + Dense(dt, name="o")(attn)

        return swiglu_residual(cfg, dt, x), None


class Llama(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: LlamaConfig
    dtype: Any = jnp.float32

    def sliding_window(self) -> int | None:
        """Attention window of every layer (None: plain causal); subclasses override."""
        return None

    def block(self) -> nn.Module:
        """The layer stack: `LlamaBlock` scanned over the layers; a family with another block
        (Qwen's biases and q/k norms) overrides this and keeps the rest of the model."""
        return stacked(LlamaBlock, self.cfg.num_layers, 2)(
            self.cfg, self.dtype, self.sliding_window(), name="layers"
        )

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = config_rope_tables(cfg, tokens.shape[1])
        x, _ = self.block()(x, cos, sin)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.tie_word_embeddings, dt)
        return logits.astype(jnp.float32)
