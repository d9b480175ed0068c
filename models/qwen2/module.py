"""Qwen2 / Qwen2.5 family in Flax linen, numerically like transformers' Qwen2ForCausalLM; its
block also serves Qwen3 (`models.qwen3.module`).

Rules from huggingface/transformers:src/transformers/models/qwen2/modeling_qwen2.py: Llama's
(`models.llama.module`: RMSNorm with fp32 statistics, half-split RoPE of the config's rope type
(`models.rope`), GQA, SwiGLU, pre-norm residual blocks, untied `lm_head` or tied
`embed.embedding.T`; the pieces are imported, not copied) with `Qwen2Attention`'s biases on
q_proj, k_proj and v_proj (o_proj has none), added before RoPE. The attention options come
from the config (`qkv_bias`, `o_bias`, `qk_norm`), so the same `QwenBlock` builds Qwen3
(per-head q/k RMSNorm before RoPE,
huggingface/transformers:src/transformers/models/qwen3/modeling_qwen3.py `Qwen3Attention`).

Params (fp32, kernels `[in, out]`, L = num_layers, hd = head_dim): Llama's (see
`models.llama.module`) plus
  layers.q.bias [L, heads*hd] (axes layers, heads); layers.{k,v}.bias [L, kv_heads*hd]
  (layers, kv_heads)                                          when cfg.qkv_bias (Qwen2: always);
  layers.o.bias [L, embed] (layers, None: replicated, like the norm scales)  when cfg.o_bias;
  layers.{q_norm,k_norm}.scale [L, hd] (layers, None)         when cfg.qk_norm (Qwen3).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import causal_attention, dense, normal, stacked
from models.llama.module import RMSNorm, apply_rope
from models.rope import config_rope_tables


class QwenBlock(nn.Module):
    """One pre-norm decoder layer; `cfg` is a Qwen2Config or Qwen3Config (or any LlamaConfig
    with the attention options `qkv_bias`, `o_bias`, `qk_norm`)."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd = cfg.head_dim

        def heads(h: jax.Array, n: int, axis: str, name: str) -> jax.Array:
            bias = (axis,) if cfg.qkv_bias else None
            return dense(n * hd, ("embed", axis), name, dt, bias_axes=bias)(h).reshape(b, s, n, hd)

        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = heads(h, cfg.num_heads, "heads", "q")
        k = heads(h, cfg.num_kv_heads, "kv_heads", "k")
        v = heads(h, cfg.num_kv_heads, "kv_heads", "v")
        if cfg.qk_norm:  # over head_dim, per head, before RoPE
            q = RMSNorm(cfg.rms_norm_eps, dt, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dt, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, cfg.num_heads * hd)
        o_bias = (None,) if cfg.o_bias else None
        x = x + dense(cfg.hidden_size, ("heads", "embed"), "o", dt, bias_axes=o_bias)(attn)

        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        gate = dense(cfg.intermediate_size, ("embed", "mlp"), "gate", dt)(h)
        up = dense(cfg.intermediate_size, ("embed", "mlp"), "up", dt)(h)
        x = x + dense(cfg.hidden_size, ("mlp", "embed"), "down", dt)(nn.silu(gate) * up)
        return x, None


class Qwen2(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: Any
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dt,
            param_dtype=jnp.float32,
            embedding_init=normal(("vocab", "embed")),
            name="embed",
        )
        cos, sin = config_rope_tables(cfg, tokens.shape[1])
        x, _ = stacked(QwenBlock, cfg.num_layers, 2)(cfg, dt, name="layers")(
            embed(tokens), cos, sin
        )
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(cfg.vocab_size, ("embed", "vocab"), "lm_head", dt)(x)
        return logits.astype(jnp.float32)
