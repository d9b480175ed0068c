"""DeepSeek V3 in Flax linen, numerically like transformers' DeepseekV3ForCausalLM.

Rules from huggingface/transformers:src/transformers/models/deepseek_v3/modeling_deepseek_v3.py
(5.23):
- RMSNorm as Llama's (`models.llama.module.RMSNorm`); the decoder's norms use `rms_norm_eps`,
  the two latent norms `q_a_layernorm` / `kv_a_layernorm` transformers' default eps 1e-6
  (`DeepseekV3RMSNorm(rank)`: the config's eps is not passed).
- MLA (`DeepseekV3Attention`): q = q_proj(x), or q_b(q_a_norm(q_a(x))) with `q_lora_rank`;
  per head `[qk_nope | qk_rope]`. kv_a(x) = `[kv_lora_rank latent | qk_rope shared k_rot]`;
  kv_b(kv_a_norm(latent)) per head `[k_nope (qk_nope) | v (v_head_dim)]`; k_rot is one head,
  broadcast to all. RoPE on q_rot and k_rot only, of width qk_rope_head_dim (`models.rope`
  tables, yarn's attention factor on cos/sin); with `rope_interleave` (DeepSeek's checkpoints)
  the pairs are `(x0, x1), (x2, x3), ...` and the result is written half-split:
  `cat(x_even * cos - x_odd * sin, x_odd * cos + x_even * sin)` (`apply_rotary_pos_emb_interleave`,
  the same layout change on q and k, so scores are as DeepSeek's); without it Llama's
  rotate_half. Softmax scale `cfg.softmax_scale` (qk_head_dim ** -0.5 times yarn's mscale**2).
- MLP: dense layers (`first_k_dense_replace`) a SwiGLU; MoE layers `models.deepseek_v3.routing`
  (sigmoid router, correction bias for choosing only, group-limited top-k) over the routed
  experts (dense dispatch: every expert on every token, weighted by the routing weights, zero
  for unchosen ones; activations `[tokens, experts, moe_intermediate_size]`, fine at test
  sizes, not for serving), plus the shared SwiGLU on the same input.

Params: the family's table (`models.deepseek_v3.params`: the groups `layers`, `mlp`, `moe`,
`mtp` as `models.moe` lays them out, and why the latent dims are not split over tp); `layers`
are created by the layer scan, the other groups whole (`models.common.TableGroup`).
"""

from __future__ import annotations

from collections.abc import Callable
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
from hybridckpt.models.deepseek_v3.config import DeepseekV3Config
from hybridckpt.models.deepseek_v3.routing import route
from hybridckpt.models.llama.module import RMSNorm, apply_rope
from hybridckpt.models.moe import experts_swiglu, group_mlp, layer_groups, swiglu
from hybridckpt.models.rope import rope_tables

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, used by q_a_layernorm / kv_a_layernorm


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' `apply_rotary_pos_emb_interleave`: x `[b, s, h, d]`, pairs (x0, x1), ...
    rotated by one frequency each, written back half-split; cos/sin `[s, d]` (angles repeated
    over halves: the first half is used), cast to x's dtype."""
    half = x.shape[-1] // 2
    cos = cos[None, :, None, :half].astype(x.dtype)
    sin = sin[None, :, None, :half].astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mla(
    cfg: DeepseekV3Config,
    dt: Any,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    select: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """Multi-head latent attention of the normed `x` `[b, s, embed]` (inside a compact module:
    the params are its own). `select(q_latent)`, given the normed q latent `[b, s, q_lora_rank]`,
    returns bool `[b, s, s]`: the keys each query may see beyond the causal mask (DeepSeek V3.2's
    indexer, `models.deepseek_v32.indexer`); None: all of them."""
    b, s, _ = x.shape
    H, nope, rope, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if select is not None and cfg.q_lora_rank is None:
        raise ValueError("mla: an indexer's selection needs the q latent (q_lora_rank)")
    keep = None
    if cfg.q_lora_rank is None:
        q = Dense(dt, name="q")(x)
    else:
        q = Dense(dt, name="q_a")(x)
        q = RMSNorm(LATENT_NORM_EPS, dt, name="q_a_norm")(q)
        keep = None if select is None else select(q)
        q = Dense(dt, name="q_b")(q)
    q = q.reshape(b, s, H, cfg.qk_head_dim)
    q_pass, q_rot = q[..., :nope], q[..., nope:]

    kv = Dense(dt, name="kv_a")(x)
    latent, k_rot = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank :]
    latent = RMSNorm(LATENT_NORM_EPS, dt, name="kv_a_norm")(latent)
    k_rot = k_rot.reshape(b, s, 1, rope)
    rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
    q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)

    kv = Dense(dt, name="kv_b")(latent).reshape(b, s, H, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (b, s, H, rope))], axis=-1)
    q = jnp.concatenate([q_pass, q_rot], axis=-1)
    attn = causal_attention(q, k, v, cfg.softmax_scale, keep=keep).reshape(b, s, H * vd)
    return Dense(dt, name="o")(attn)


def deepseek_moe(cfg: DeepseekV3Config, dt: Any, x: jax.Array, p: dict) -> jax.Array:
    """`DeepseekV3MoE.forward` of the normed `x` `[b, s, embed]` with one layer's `moe` params:
    the routed experts (`models.moe.experts_swiglu`, a dense dispatch) weighted by
    `routing.route`, plus the shared SwiGLU on the same input."""
    shape = x.shape
    h = x.reshape(-1, shape[-1])
    weights = route(cfg, h, p["router"]["kernel"], p["router"]["bias"])
    routed = experts_swiglu(h, weights, p["experts"], dt).reshape(shape)
    return routed + swiglu(x, p["shared"], dt)


class DecoderLayer(nn.Module):
    """One decoder layer: norms and MLA are its own params (scanned: `layers`); its MLP is layer
    `pos` of the `moe` group when `is_moe`, else of the dense `mlp` group (`models.moe`)."""

    cfg: DeepseekV3Config
    dtype: Any
    # the attention of the normed input, `attend(cfg, dt, h, cos, sin)` (a subclass's own: V3.2)
    attend = staticmethod(mla)

    @nn.compact
    def __call__(self, x, cos, sin, moe, mlp, is_moe, pos):
        cfg, dt = self.cfg, self.dtype
        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        x = x + self.attend(cfg, dt, h, cos, sin)
        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        y = group_mlp(
            h,
            is_moe,
            pos,
            moe,
            mlp,
            lambda h, p: deepseek_moe(cfg, dt, h, p),
            lambda h, p: swiglu(h, p, dt),
        )
        return x + y, None


class MTP(nn.Module):
    """The params of the MTP modules (DeepSeek-V3 README_WEIGHTS.md: `embed_tokens`, `enorm`,
    `hnorm`, `eh_proj`, a decoder layer, `shared_head.{norm,head}`), each on a leading axis of
    the `n` modules. Called only at init, to create them: the forward pass does not use MTP
    (neither does transformers')."""

    cfg: DeepseekV3Config
    dtype: Any
    layer_cls = DecoderLayer  # a class attribute (Flax wraps no class): V3.2 gives its own

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> None:
        cfg, n = self.cfg, self.cfg.mtp_layers
        table_params(self, skip=("layers", "moe"))  # embed, enorm, hnorm, eh_proj, head_norm, head
        moe = TableGroup(name="moe")()
        block = stacked(self.layer_cls, n, 4, 2, axis=None)(cfg, self.dtype, name="layers")
        is_moe, pos = jnp.ones((n,), bool), jnp.arange(n, dtype=jnp.int32)
        block(x, cos, sin, moe, None, is_moe, pos)


class DeepseekV3(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: DeepseekV3Config
    dtype: Any = jnp.float32
    layer_cls = DecoderLayer  # class attributes: V3.2 gives its own
    mtp_cls = MTP

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = rope_tables(
            tokens.shape[1],
            cfg.qk_rope_head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        dense_layers, L = cfg.num_dense_layers, cfg.num_layers
        moe = mlp = None  # as jax arrays: a layer's slice is a traced index into them
        if cfg.num_moe_layers:
            moe = jax.tree.map(jnp.asarray, TableGroup(name="moe")())
        if dense_layers:
            mlp = jax.tree.map(jnp.asarray, TableGroup(name="mlp")())
        is_moe, pos = layer_groups(tuple(range(dense_layers, L)), L)
        layers = stacked(self.layer_cls, L, 4, 2)(cfg, dt, name="layers")
        x, _ = layers(x, cos, sin, moe, mlp, is_moe, pos)
        if cfg.mtp_layers and self.is_initializing():
            self.mtp_cls(cfg, dt, name="mtp")(x, cos, sin)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.tie_word_embeddings, dt)
        return logits.astype(jnp.float32)
