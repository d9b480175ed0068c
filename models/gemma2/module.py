"""Gemma 2 family in Flax linen, numerically like transformers' Gemma2ForCausalLM; Gemma 3
(`models.gemma3.module`) is this module with q/k norms and a second RoPE table.

Rules from huggingface/transformers:src/transformers/models/gemma2/modeling_gemma2.py:
- RMSNorm (`Gemma2RMSNorm`): x fp32 * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, then cast back
  to x's dtype; the stored w is zero-centred (init 0), so (1 + w) is the scale.
- Embeddings times sqrt(hidden_size), that scalar cast to the compute dtype first
  (`Gemma2TextScaledWordEmbedding`).
- Four norms per layer: x += attn_out_norm(attn(attn_norm(x))); x += mlp_out_norm(mlp(mlp_norm(x)))
  (HF: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
  post_feedforward_layernorm).
- Attention: scale `query_pre_attn_scalar ** -0.5`; scores soft-capped `tanh(s / c) * c` with
  c = attn_logit_softcapping before the mask (`eager_attention_forward`); GQA as Llama's; RoPE
  half-split as Llama's, of any rope type `models.rope` implements. Local layers mask keys at
  distance >= sliding_window.
- MLP: down(gelu_tanh(gate(x)) * up(x)) (`gelu_pytorch_tanh`).
- Logits (tied `embed.embedding.T` or `lm_head`) soft-capped with final_logit_softcapping.

How Gemma's alternating layers are stacked: every layer, local or global, has the same params, so
all are stacked on one leading `layers` axis (sharded over `pp`) and run by one `nn.scan`. Which
kind a layer is is data, not structure: `cfg.sliding_layers` enters the scan as a per-layer bool
(a scanned input, `stacked(..., n_per_layer=1)`), and inside the block `jnp.where` picks the
attention window (sliding_window, or the whole sequence) and the RoPE table (row 1 for local
layers, row 0 for global ones; the two rows are equal in Gemma 2, they differ in Gemma 3).

Params: the family's table (`models.gemma2.params`; fp32, kernels `[in, out]`, norm scales
zero-centred); Gemma 3's (`models.gemma3.params`) adds layers.{q_norm,k_norm}.scale [L, hd].
"""

from __future__ import annotations

from typing import Any, ClassVar

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
from hybridckpt.models.gemma2.config import Gemma2Config
from hybridckpt.models.llama.module import apply_rope
from hybridckpt.models.rope import config_rope_tables


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + w), all in fp32, cast back to the input's dtype."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = table_param(self, "scale")
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + w)).astype(x.dtype)


class GemmaBlock(nn.Module):
    """One decoder layer. cos/sin `[2, seq, hd]` (row 0 global, row 1 local); `sliding` a bool
    scalar: this layer's kind."""

    cfg: Any  # Gemma2Config or Gemma3Config
    dtype: Any
    qk_norm: bool
    attn_softcap: float | None

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, sliding: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd, eps = cfg.head_dim, cfg.rms_norm_eps

        h = GemmaRMSNorm(eps, name="attn_norm")(x)
        q = Dense(dt, name="q")(h)
        k = Dense(dt, name="k")(h)
        v = Dense(dt, name="v")(h)
        q = q.reshape(b, s, cfg.num_heads, hd)
        k = k.reshape(b, s, cfg.num_kv_heads, hd)
        v = v.reshape(b, s, cfg.num_kv_heads, hd)
        if self.qk_norm:  # per head, before RoPE
            q = GemmaRMSNorm(eps, name="q_norm")(q)
            k = GemmaRMSNorm(eps, name="k_norm")(k)
        cos, sin = jnp.where(sliding, cos[1], cos[0]), jnp.where(sliding, sin[1], sin[0])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        window = jnp.where(sliding, cfg.sliding_window or s, s)  # a global layer sees all of seq
        scale = cfg.query_pre_attn_scalar**-0.5
        attn = causal_attention(q, k, v, scale, softcap=self.attn_softcap, window=window)
        attn = Dense(dt, name="o")(attn.reshape(b, s, -1))
        x = x + GemmaRMSNorm(eps, name="attn_out_norm")(attn)

        h = GemmaRMSNorm(eps, name="mlp_norm")(x)
        gate = Dense(dt, name="gate")(h)
        up = Dense(dt, name="up")(h)
        h = Dense(dt, name="down")(nn.gelu(gate, approximate=True) * up)
        x = x + GemmaRMSNorm(eps, name="mlp_out_norm")(h)
        return x, None


class Gemma2(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: Gemma2Config
    dtype: Any = jnp.float32

    qk_norm: ClassVar[bool] = False

    def attention_softcap(self) -> float | None:
        return self.cfg.attn_logit_softcapping

    def embedding_scale(self) -> float:
        """What the embeddings are multiplied by: sqrt(hidden_size)."""
        return self.cfg.hidden_size**0.5

    def rope(self, seq: int) -> tuple[jax.Array, jax.Array]:
        """cos, sin `[2, seq, hd]`: row 0 for global layers, row 1 for local ones."""
        cos, sin = config_rope_tables(self.cfg, seq)
        return jnp.stack([cos, cos]), jnp.stack([sin, sin])

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens) * jnp.float32(self.embedding_scale()).astype(dt)
        cos, sin = self.rope(tokens.shape[1])
        sliding = jnp.asarray(cfg.sliding_layers, dtype=bool)
        layers = stacked(GemmaBlock, cfg.num_layers, 2, n_per_layer=1)(
            cfg, dt, self.qk_norm, self.attention_softcap(), name="layers"
        )
        x, _ = layers(x, cos, sin, sliding)
        x = GemmaRMSNorm(cfg.rms_norm_eps, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.tie_word_embeddings, dt)
        cap = cfg.final_logit_softcapping
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits.astype(jnp.float32)
