"""SmolLM3 in Flax linen, numerically like transformers' SmolLM3ForCausalLM
(huggingface/transformers:src/transformers/models/smollm3/modeling_smollm3.py): Llama's model
(`models.llama.module`: RMSNorm with fp32 statistics, half-split RoPE of the config's rope type,
GQA, SwiGLU, tied or untied head) whose layer i rotates q and k only when the config's
`use_rope_layers[i]` (`SmolLM3Attention`: `if self.use_rope: apply_rotary_pos_emb`); a NoPE
layer attends with the causal mask alone. The flag is per-layer data of the layer scan.

Params: exactly Llama's tree (see `models.llama.module`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import Dense, causal_attention, stacked
from hybridckpt.models.llama.module import Llama, RMSNorm, apply_rope, swiglu_residual


class SmolLM3Block(nn.Module):
    """One pre-norm layer; `use_rope` (a traced bool of the scan) says whether q, k rotate."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, use_rope: jax.Array):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd = cfg.head_dim
        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = Dense(dt, name="q")(h).reshape(b, s, cfg.num_heads, hd)
        k = Dense(dt, name="k")(h).reshape(b, s, cfg.num_kv_heads, hd)
        v = Dense(dt, name="v")(h).reshape(b, s, cfg.num_kv_heads, hd)
        q = jnp.where(use_rope, apply_rope(q, cos, sin), q)
        k = jnp.where(use_rope, apply_rope(k, cos, sin), k)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, cfg.num_heads * hd)
        x = x + Dense(dt, name="o")(attn)
        return swiglu_residual(cfg, dt, x), None


class SmolLM3(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32: Llama's model with
    `SmolLM3Block` layers, each given its RoPE flag."""

    def block(self) -> nn.Module:
        layers = stacked(SmolLM3Block, self.cfg.num_layers, 2, 1)(
            self.cfg, self.dtype, name="layers"
        )
        flags = jnp.array(self.cfg.use_rope_layers)
        return lambda x, cos, sin: layers(x, cos, sin, flags)
