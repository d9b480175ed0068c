"""GPT-2 family in Flax linen, numerically like transformers' GPT2LMHeadModel.

Rules from huggingface/transformers:src/transformers/models/gpt2/modeling_gpt2.py: learned
positions added to token embeddings; pre-LayerNorm blocks (eps = layer_norm_epsilon); fused
qkv projection; scores scaled by head_dim**-0.5; MLP proj(gelu_new(fc(x))), gelu_new being the
tanh approximation (openai/gpt-2:src/model.py `gelu`); final LayerNorm `ln_f`; head tied to `wte`.

Params: the family's table (`models.gpt2.params`; fp32, kernels `[in, out]`, per-layer params
stacked on a leading `[L]` axis); `layers.qkv.kernel` is `[L, E, 3, E]` (axis 2 = q, k, v; the
last axis head-major heads * head_dim), so the qkv projection gives `[..., 3, E]`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Dense, Embed, LayerNorm, causal_attention, stacked
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.gpt2.config import GPT2Config


def layer_norm(eps: float, dtype: Any, name: str) -> nn.Module:
    """LayerNorm with fp32 statistics (two-pass variance, like torch); params from the table."""
    return LayerNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32, use_fast_variance=False, name=name)


class GPT2Block(nn.Module):
    cfg: GPT2Config
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, e = x.shape
        heads, hd = cfg.n_head, cfg.head_dim

        h = layer_norm(cfg.layer_norm_epsilon, dt, "ln_1")(x)
        qkv = Dense(dt, name="qkv")(h)
        q, k, v = (qkv[:, :, i].reshape(b, s, heads, hd) for i in range(3))
        attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, e)
        x = x + Dense(dt, name="attn_out")(attn)

        h = layer_norm(cfg.layer_norm_epsilon, dt, "ln_2")(x)
        h = nn.gelu(Dense(dt, name="fc")(h), approximate=True)
        x = x + Dense(dt, name="proj")(h)
        return x, None


class GPT2(nn.Module):
    """tokens `[batch, seq]` int (seq <= n_positions) -> logits `[batch, seq, vocab]` float32."""

    cfg: GPT2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        seq = tokens.shape[1]
        if seq > cfg.n_positions:
            raise ConfigError(f"GPT-2: sequence length {seq} exceeds n_positions {cfg.n_positions}")
        wte, wpe = Embed(dt, name="wte"), Embed(dt, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(seq))[None]
        x, _ = stacked(GPT2Block, cfg.n_layer, 0)(cfg, dt, name="layers")(x)
        x = layer_norm(cfg.layer_norm_epsilon, dt, "ln_f")(x)
        return wte.attend(x).astype(jnp.float32)
