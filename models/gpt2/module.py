"""GPT-2 family in Flax linen, numerically like transformers' GPT2LMHeadModel.

Rules from huggingface/transformers:src/transformers/models/gpt2/modeling_gpt2.py: learned
positions added to token embeddings; pre-LayerNorm blocks (eps = layer_norm_epsilon); fused
qkv projection; scores scaled by head_dim**-0.5; MLP proj(gelu_new(fc(x))), gelu_new being the
tanh approximation (openai/gpt-2:src/model.py `gelu`); final LayerNorm `ln_f`; head tied to `wte`.

Params (fp32, kernels `[in, out]`, L = n_layer, E = n_embd):
  wte.embedding [vocab, E]; wpe.embedding [n_positions, E];
  layers.{ln_1,ln_2}.{scale,bias} [L, E];
  layers.qkv.kernel [L, E, 3, E] (axis 2 = q, k, v; last axis head-major heads*head_dim),
  layers.qkv.bias [L, 3, E];  HF c_attn.weight [E, 3E] reshaped to [E, 3, E] is this kernel;
  layers.attn_out.kernel [L, E, E], .bias [L, E]; layers.fc.kernel [L, E, inner], .bias [L, inner];
  layers.proj.kernel [L, inner, E], .bias [L, E]; ln_f.{scale,bias} [E].
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import causal_attention, dense, normal, ones, stacked, zeros
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.gpt2.config import GPT2Config


def layer_norm(eps: float, dtype: Any, name: str) -> nn.Module:
    """LayerNorm with fp32 statistics (two-pass variance, like torch)."""
    return nn.LayerNorm(
        epsilon=eps,
        dtype=dtype,
        param_dtype=jnp.float32,
        use_fast_variance=False,
        scale_init=ones((None,)),
        bias_init=zeros((None,)),
        name=name,
    )


class GPT2Block(nn.Module):
    cfg: GPT2Config
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, e = x.shape
        heads, hd = cfg.n_head, cfg.head_dim

        h = layer_norm(cfg.layer_norm_epsilon, dt, "ln_1")(x)
        qkv = dense((3, e), ("embed", None, "heads"), "qkv", dt, bias_axes=(None, "heads"))(h)
        q, k, v = (qkv[:, :, i].reshape(b, s, heads, hd) for i in range(3))
        attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, e)
        x = x + dense(e, ("heads", "embed"), "attn_out", dt, bias_axes=(None,))(attn)

        h = layer_norm(cfg.layer_norm_epsilon, dt, "ln_2")(x)
        h = dense(cfg.n_inner, ("embed", "mlp"), "fc", dt, bias_axes=("mlp",))(h)
        h = nn.gelu(h, approximate=True)
        x = x + dense(e, ("mlp", "embed"), "proj", dt, bias_axes=(None,))(h)
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
        wte = nn.Embed(
            cfg.vocab_size,
            cfg.n_embd,
            dtype=dt,
            param_dtype=jnp.float32,
            embedding_init=normal(("vocab", "embed")),
            name="wte",
        )
        wpe = nn.Embed(
            cfg.n_positions,
            cfg.n_embd,
            dtype=dt,
            param_dtype=jnp.float32,
            embedding_init=normal((None, "embed")),
            name="wpe",
        )
        x = wte(tokens) + wpe(jnp.arange(seq))[None]
        x, _ = stacked(GPT2Block, cfg.n_layer, 0)(cfg, dt, name="layers")(x)
        x = layer_norm(cfg.layer_norm_epsilon, dt, "ln_f")(x)
        return wte.attend(x).astype(jnp.float32)
