"""Granite in Flax linen, numerically like transformers' GraniteForCausalLM.

Rules from huggingface/transformers:src/transformers/models/granite/modeling_granite.py: Llama's
model (`models.llama.module`) with the config's four scalars (`models.granite.config`):
embeddings times `embedding_multiplier`; in each block `x + attn(norm(x)) * residual_multiplier`
and `x + mlp(norm(x)) * residual_multiplier`; attention scores times `attention_multiplier`
(not head_dim ** -0.5); logits divided by `logits_scaling` (after the fp32 head, as transformers
divides the head's output).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Dense, Embed, causal_attention, output_logits, stacked
from hybridckpt.models.llama.module import Llama, RMSNorm, apply_rope
from hybridckpt.models.rope import config_rope_tables


class GraniteBlock(nn.Module):
    """One pre-norm block with the residual multiplier and the attention multiplier."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd, mult = cfg.head_dim, cfg.residual_multiplier

        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = apply_rope(Dense(dt, name="q")(h).reshape(b, s, cfg.num_heads, hd), cos, sin)
        k = apply_rope(Dense(dt, name="k")(h).reshape(b, s, cfg.num_kv_heads, hd), cos, sin)
        v = Dense(dt, name="v")(h).reshape(b, s, cfg.num_kv_heads, hd)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        attn = causal_attention(q, k, v, cfg.attention_multiplier).reshape(b, s, cfg.num_heads * hd)
        x = x + Dense(dt, name="o")(attn) * mult

        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        m = Dense(dt, name="down")(nn.silu(Dense(dt, name="gate")(h)) * Dense(dt, name="up")(h))
        return x + m * mult, None


class Granite(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens) * cfg.embedding_multiplier
        cos, sin = config_rope_tables(cfg, tokens.shape[1])
        x, _ = stacked(GraniteBlock, cfg.num_layers, 2)(cfg, dt, name="layers")(x, cos, sin)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.tie_word_embeddings, dt)
        return logits.astype(jnp.float32) / cfg.logits_scaling
