"""Llama 4 text in Flax linen, numerically like transformers 5.24's Llama4ForCausalLM
(huggingface/transformers:src/transformers/models/llama4/modeling_llama4.py).

Per layer (one `nn.scan` over all layers; per-layer data `is_moe`, `pos`, `use_rope`, `chunked`
from the config):
- attention: RMSNorm; q, k, v; on a RoPE layer q and k rotated on interleaved pairs
  (`apply_rotary_emb`: `(x[2i], x[2i+1])` as a complex number times `e^(i pos inv_freq_i)`, in
  fp32, cast back) and then, with `use_qk_norm`, each normalised by a weightless L2 norm
  (`Llama4TextL2Norm`: x fp32 * rsqrt(mean(x^2) + rms_norm_eps)); on a NoPE layer, with
  `attn_temperature_tuning`, q times `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`
  (fp32, cast back); GQA; scores `q k^T * head_dim^-0.5`, causal, and on a chunked layer only
  keys of the query's `attention_chunk_size` chunk (`create_chunked_causal_mask`); softmax in
  the compute dtype (Llama 4's eager attention does not upcast).
- MLP: RMSNorm, then on an MoE layer the router logits `h @ router` (top-k kept, sigmoid in fp32,
  cast; others 0), every expert fed `h * its score` (dense dispatch: an unchosen expert's input
  is 0, its output exactly 0, as transformers computes it), `down(up * silu(gate))` per expert,
  summed, plus the shared expert's SwiGLU of h; on a dense layer a SwiGLU of width
  `intermediate_size_mlp`.
Then the final RMSNorm and the head (untied, or the embedding's transpose when tied).

Params: the family's table (`models.llama4.params`), the MoE and dense groups created whole
outside the scan (`models.common.TableGroup`) and picked per layer (`models.moe.group_mlp`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hybridckpt.models import moe
from hybridckpt.models.common import Dense, Embed, TableGroup, output_logits, stacked
from hybridckpt.models.llama.module import RMSNorm
from hybridckpt.models.rope import rope_frequencies


def pair_rope_tables(cfg: Any, seq: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[seq, head_dim / 2]` fp32 of positions 0..seq-1 (one per interleaved pair), times
    the rope type's attention scaling (`Llama4TextRotaryEmbedding`: `polar(1, pos * inv_freq)`)."""
    inv_freq, scaling = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, seq,
                                         max_position_embeddings=cfg.max_position_embeddings)  # fmt: skip
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling != 1.0:
        cos, sin = cos * np.float32(scaling), sin * np.float32(scaling)
    return cos, sin


def apply_pair_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[batch, seq, heads, hd]`: pairs `(x[2i], x[2i+1])` rotated in fp32, cast back to x's dtype."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.stack([re * c - im * s, re * s + im * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """`Llama4TextL2Norm`: x fp32 * rsqrt(mean(x^2) + eps) over the last axis, cast back (no weight)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def temperature(cfg: Any, seq: int) -> jax.Array:
    """The NoPE layers' query scale `[seq]` fp32: log1p(floor((pos + 1) / floor_scale)) *
    attn_scale + 1 (ones without `attn_temperature_tuning`)."""
    pos = jnp.arange(seq, dtype=jnp.float32)
    if not cfg.attn_temperature_tuning:
        return jnp.ones_like(pos)
    return jnp.log1p(jnp.floor((pos + 1.0) / np.float32(cfg.floor_scale))) * np.float32(cfg.attn_scale) + 1.0


def attention_mask(seq: int, chunk: int | None, chunked: jax.Array) -> jax.Array:
    """`[seq, seq]` bool: causal, and on a chunked layer (`chunked`, traced) same chunk only."""
    pos = jnp.arange(seq)
    mask = pos[None, :] <= pos[:, None]
    if chunk is None:
        return mask
    same = (pos[None, :] // chunk) == (pos[:, None] // chunk)
    return mask & (same | ~chunked)


def moe_mlp(cfg: Any, dt: Any, h: jax.Array, p: dict) -> jax.Array:
    """One MoE layer's MLP on h `[..., E]` (`Llama4TextMoe`): the shared expert plus the routed
    experts fed `h * score` (module docstring)."""
    shape = h.shape
    t = h.reshape(-1, shape[-1]).astype(dt)
    logits = t @ p["router"]["kernel"].astype(dt)  # [T, X]
    vals, idx = jax.lax.top_k(logits, cfg.num_experts_per_tok)
    scores = jax.nn.sigmoid(vals.astype(jnp.float32)).astype(dt)
    w = jnp.sum(jax.nn.one_hot(idx, logits.shape[-1], dtype=dt) * scores[..., None], axis=-2)  # [T, X]
    routed_in = t[None, :, :] * w.T[:, :, None]  # [X, T, E]
    gate_up = p["experts"]["gate_up"]["kernel"].astype(dt)  # [X, E, 2, M]
    gate = jnp.einsum("xte,xem->xtm", routed_in, gate_up[:, :, 0])
    up = jnp.einsum("xte,xem->xtm", routed_in, gate_up[:, :, 1])
    out = jnp.einsum("xtm,xme->xte", up * nn.silu(gate), p["experts"]["down"]["kernel"].astype(dt))
    return (moe.swiglu(t, p["shared"], dt) + out.sum(axis=0)).reshape(shape)


class Llama4Block(nn.Module):
    """One pre-norm layer (module docstring); per-layer inputs `is_moe`, `pos`, `use_rope`, `chunked`."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x, cos, sin, temp, moe_params, dense_params, is_moe, pos, use_rope, chunked):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd = cfg.head_dim
        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = Dense(dt, name="q")(h).reshape(b, s, cfg.num_heads, hd)
        k = Dense(dt, name="k")(h).reshape(b, s, cfg.num_kv_heads, hd)
        v = Dense(dt, name="v")(h).reshape(b, s, cfg.num_kv_heads, hd)
        q_rope, k_rope = apply_pair_rope(q, cos, sin), apply_pair_rope(k, cos, sin)
        if cfg.use_qk_norm:
            q_rope, k_rope = l2_norm(q_rope, cfg.rms_norm_eps), l2_norm(k_rope, cfg.rms_norm_eps)
        q_nope = (q.astype(jnp.float32) * temp[None, :, None, None]).astype(q.dtype)
        q = jnp.where(use_rope, q_rope, q_nope)
        k = jnp.where(use_rope, k_rope, k)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(hd**-0.5, q.dtype)
        mask = attention_mask(s, cfg.attention_chunk_size, chunked)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.num_heads * hd)
        x = x + Dense(dt, name="o")(attn)

        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)

        def sparse(h, p):
            return moe_mlp(cfg, dt, h, p)

        def dense(h, p):
            return moe.swiglu(h, p, dt)

        return x + moe.group_mlp(h, is_moe, pos, moe_params, dense_params, sparse, dense), None


class Llama4(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: Llama4Config)."""

    cfg: Any
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        seq = tokens.shape[1]
        cos, sin = pair_rope_tables(cfg, seq)
        moe_params = TableGroup(name="moe")() if cfg.moe_layers else None
        dense_params = TableGroup(name="mlp")() if cfg.dense_layers else None
        is_moe, pos = moe.layer_groups(cfg.moe_layers, cfg.num_layers)
        use_rope = jnp.array(cfg.rope_layers)
        chunked = jnp.array(cfg.chunked_layers)
        layers = stacked(Llama4Block, cfg.num_layers, 5, 4)(cfg, dt, name="layers")
        x, _ = layers(x, cos, sin, temperature(cfg, seq), moe_params, dense_params, is_moe, pos, use_rope, chunked)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        return output_logits(x, embed, cfg.tie_word_embeddings, dt).astype(jnp.float32)
