"""GLM-4.5 in Flax linen, numerically like transformers' Glm4MoeForCausalLM.

Rules from huggingface/transformers:src/transformers/models/glm4_moe/modeling_glm4_moe.py (5.24):
- RMSNorm as Llama's (`models.llama.module.RMSNorm`), every norm with `rms_norm_eps`.
- `Glm4MoeAttention`: q, k, v = q_proj(h), k_proj(h), v_proj(h) (with biases when the table has
  them), viewed per head; with `use_qk_norm` q_norm / k_norm RMS-normalise each head (`[D]`
  scales) before RoPE; `apply_rotary_pos_emb`: half-split RoPE over the first `rotary_dim` dims
  of each head, the rest passed through (`models.phi3.module.partial_rope`), cos/sin of
  `models.rope.rope_tables` over `rotary_dim` (any rope type); GQA, causal, scale
  head_dim ** -0.5; o_proj without bias.
- MLP: layers below `first_k_dense_replace` a SwiGLU; the others `Glm4MoeMoE`, which is
  DeepSeek V3's MoE computed the same way (`models.deepseek_v3.module.deepseek_moe`: sigmoid
  router in fp32, correction bias for choosing only, group-limited top-k, renormalisation,
  `routed_scaling_factor`; dense dispatch over the experts; plus the shared SwiGLU).

`Glm4MoeConfig.use_qk_norm`, `partial_rotary_factor`, `attention_bias` and the MoE fields are
read when traced, so a test can turn each off and see the logits move.

Params: the family's table (`models.glm4_moe.params`: `layers` created by the layer scan, the
groups `mlp`, `moe`, `mtp` whole, `models.common.TableGroup`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import (
    Dense,
    Embed,
    TableGroup,
    causal_attention,
    output_logits,
    stacked,
    table_params,
)
from hybridckpt.models.deepseek_v3.module import deepseek_moe
from hybridckpt.models.glm4_moe.config import Glm4MoeConfig
from hybridckpt.models.llama.module import RMSNorm
from hybridckpt.models.moe import group_mlp, layer_groups, swiglu
from hybridckpt.models.phi3.module import partial_rope
from hybridckpt.models.rope import rope_tables


def attention(cfg: Glm4MoeConfig, dt: Any, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`o(attn(x))` of the normed `x` `[b, s, embed]`: GQA with biases, optional per-head q/k
    norm and partial rotary (module docstring); called inside a compact module (the params are
    its own)."""
    b, s, _ = x.shape
    hd, H, KV = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = Dense(dt, name="q")(x).reshape(b, s, H, hd)
    k = Dense(dt, name="k")(x).reshape(b, s, KV, hd)
    v = Dense(dt, name="v")(x).reshape(b, s, KV, hd)
    if cfg.use_qk_norm:
        q = RMSNorm(cfg.rms_norm_eps, dt, name="q_norm")(q)
        k = RMSNorm(cfg.rms_norm_eps, dt, name="k_norm")(k)
    q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, H * hd)
    return Dense(dt, name="o")(attn)


class DecoderLayer(nn.Module):
    """One decoder layer: norms and attention are its own params (scanned: `layers`); its MLP is
    layer `pos` of the `moe` group when `is_moe`, else of the dense `mlp` group (`models.moe`)."""

    cfg: Glm4MoeConfig
    dtype: Any

    @nn.compact
    def __call__(self, x, cos, sin, moe, mlp, is_moe, pos):
        cfg, dt = self.cfg, self.dtype
        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        x = x + attention(cfg, dt, h, cos, sin)
        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        y = group_mlp(h, is_moe, pos, moe, mlp, lambda h, p: deepseek_moe(cfg, dt, h, p),
                      lambda h, p: swiglu(h, p, dt))  # fmt: skip
        return x + y, None


class MTP(nn.Module):
    """The params of the MTP modules (`embed_tokens`, `enorm`, `hnorm`, `eh_proj`, a decoder
    layer, `shared_head.{norm,head}`), each on a leading axis of the `n` modules. Called only at
    init, to create them: the forward pass does not use MTP (neither does transformers')."""

    cfg: Glm4MoeConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> None:
        cfg, n = self.cfg, self.cfg.mtp_layers
        table_params(self, skip=("layers", "moe"))
        moe = TableGroup(name="moe")()
        block = stacked(DecoderLayer, n, 4, 2, axis=None)(cfg, self.dtype, name="layers")
        block(x, cos, sin, moe, None, jnp.ones((n,), bool), jnp.arange(n, dtype=jnp.int32))


class Glm4Moe(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: Glm4MoeConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = rope_tables(tokens.shape[1], cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                               max_position_embeddings=cfg.max_position_embeddings)  # fmt: skip
        dense_layers, L = cfg.num_dense_layers, cfg.num_layers
        moe = mlp = None  # as jax arrays: a layer's slice is a traced index into them
        if cfg.num_moe_layers:
            moe = jax.tree.map(jnp.asarray, TableGroup(name="moe")())
        if dense_layers:
            mlp = jax.tree.map(jnp.asarray, TableGroup(name="mlp")())
        is_moe, pos = layer_groups(tuple(range(dense_layers, L)), L)
        x, _ = stacked(DecoderLayer, L, 4, 2)(cfg, dt, name="layers")(x, cos, sin, moe, mlp, is_moe, pos)
        if cfg.mtp_layers and self.is_initializing():
            MTP(cfg, dt, name="mtp")(x, cos, sin)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        return output_logits(x, embed, cfg.tie_word_embeddings, dt).astype(jnp.float32)
