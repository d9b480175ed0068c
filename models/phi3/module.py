"""Phi-3 in Flax linen, numerically like transformers' Phi3ForCausalLM.

Rules from huggingface/transformers:src/transformers/models/phi3/modeling_phi3.py: Llama's
pre-norm block (`models.llama.module`: RMSNorm with fp32 statistics, GQA, tied or untied head)
with
- `Phi3Attention`: qkv = qkv_proj(h), columns [0, Q) q, [Q, Q + KV) k, the rest v;
- `apply_rotary_pos_emb`: RoPE (half-split, cos/sin cast to the compute dtype) over the first
  `rotary_dim` dims of each head, the rest passed through; the tables are `models.phi3.rope`'s
  (partial rotary, longrope);
- `Phi3MLP`: gate, up = gate_up_proj(h).chunk(2) (gate first); down(up * silu(gate));
- the sliding window of `Phi3Model` (every layer, when `sliding_window` is set).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Dense, Embed, causal_attention, output_logits, stacked
from hybridckpt.models.llama.module import Llama, RMSNorm, apply_rope
from hybridckpt.models.phi3.rope import rope_tables


def partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE over x's first `cos.shape[-1]` dims (x `[batch, seq, heads, hd]`), the rest kept."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)


class Phi3Block(nn.Module):
    """One pre-norm block with the fused projections (see the module docstring)."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd = cfg.head_dim
        nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd

        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        qkv = Dense(dt, name="qkv")(h)
        q = partial_rope(qkv[..., :nq].reshape(b, s, cfg.num_heads, hd), cos, sin)
        k = partial_rope(qkv[..., nq : nq + nkv].reshape(b, s, cfg.num_kv_heads, hd), cos, sin)
        v = qkv[..., nq + nkv :].reshape(b, s, cfg.num_kv_heads, hd)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        attn = causal_attention(q, k, v, hd**-0.5, window=cfg.sliding_window)
        x = x + Dense(dt, name="o")(attn.reshape(b, s, nq))

        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        gate_up = Dense(dt, name="gate_up")(h)  # [b, s, 2, M]
        return x + Dense(dt, name="down")(gate_up[..., 1, :] * nn.silu(gate_up[..., 0, :])), None


class Phi3(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = rope_tables(cfg, tokens.shape[1])
        x, _ = stacked(Phi3Block, cfg.num_layers, 2)(cfg, dt, name="layers")(x, cos, sin)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        return output_logits(x, embed, cfg.tie_word_embeddings, dt).astype(jnp.float32)
