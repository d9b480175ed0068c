"""GPT-OSS in Flax linen, numerically like transformers' GptOssForCausalLM (eager attention).

Rules from huggingface/transformers:src/transformers/models/gpt_oss/modeling_gpt_oss.py:
- RMSNorm (`GptOssRMSNorm`): `(w * x_fp32 * rsqrt(mean(x^2) + eps)).to(dtype)` (the weight
  multiplied in fp32, unlike Llama's).
- RoPE half-split (`_apply_rotary_emb`: `[x1 cos - x2 sin, x2 cos + x1 sin]`, which is Llama's
  `apply_rope`), cos and sin of the config's rope type (yarn in the releases: its attention
  factor scales both), cast to the compute dtype.
- Attention (`eager_attention_forward`): GQA, scale head_dim ** -0.5, q/k/v/o biases; each
  head's scores (masked: causal, and on a sliding layer keys i - window < j <= i) get the
  head's sink logit as one more column; softmax over all of them, the sink column dropped, so
  the kept probabilities sum to less than 1. Scores and softmax in fp32 here (transformers
  computes them in the model dtype: the same in fp32).
- Which layers slide: `cfg.sliding_layers`, a per-layer bool entering the layer scan as data
  (as Gemma 2's, `models.gemma2.module`); every layer has the same params.
- MoE (`GptOssMLP`): router logits `h @ W.T + b`, the top-k logits (`jax.lax.top_k`, as
  torch.topk) softmaxed among themselves; each expert `gate_up = h @ W_gu + b_gu`, gate and up
  its even and odd columns,
  `glu = min(gate, limit) * sigmoid(alpha * min(gate, limit))`,
  `out = ((clip(up, -limit, limit) + 1) * glu) @ W_down + b_down`, weighted by the token's
  routing weight and summed. Dense dispatch (every expert on every token, zero weight off the
  top-k; exact, as `models.moe.experts_swiglu`).

Params: the family's table (`models.gpt_oss.params`): embed, `layers.*` (attention, sinks,
norms; scanned), `moe.*` (router and experts, created whole outside the scan by `TableGroup`
and indexed per layer), final_norm, lm_head.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models import moe
from hybridckpt.models.common import Dense, Embed, TableGroup, output_logits, stacked, table_param
from hybridckpt.models.llama.module import apply_rope
from hybridckpt.models.rope import config_rope_tables


class GptOssRMSNorm(nn.Module):
    """x fp32 * rsqrt(mean(x^2) + eps) times the fp32 weight, cast to `dtype`."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = table_param(self, "scale")
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (scale * y).astype(self.dtype)


def sink_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array, scale: float, window: Any
) -> jax.Array:
    """Causal attention with a sink logit per head. q, k, v `[batch, seq, heads, hd]` (same head
    count), sinks `[heads]`; window: keys i - window < j <= i (a traced scalar may be the whole
    sequence). Returns `[batch, seq, heads, hd]` in v's dtype."""
    b, s, h, _ = q.shape
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    pos = jnp.arange(s)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (b, h, s, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


def route(h: jax.Array, p: dict, top_k: int) -> jax.Array:
    """Routing weights `[tokens, X]`: softmax over the `top_k` largest router logits
    (`h @ kernel + bias`), zero for the other experts (`GptOssTopKRouter`)."""
    logits = h @ p["kernel"].astype(h.dtype) + p["bias"].astype(h.dtype)
    vals, idx = jax.lax.top_k(logits, top_k)
    vals = jax.nn.softmax(vals, axis=-1)
    return jnp.sum(jax.nn.one_hot(idx, logits.shape[-1], dtype=vals.dtype) * vals[..., None], axis=-2)


def clamped_swiglu(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """`(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, g = min(gate, limit);
    gate_up `[..., 2M]` (gate the even columns, up the odd) -> `[..., M]`
    (`GptOssExperts._apply_gate`)."""
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def experts(h: jax.Array, weights: jax.Array, p: dict, alpha: float, limit: float) -> jax.Array:
    """Dense dispatch: h `[tokens, E]`, weights `[tokens, X]`, p one layer's `experts` params
    -> `[tokens, E]` in h's dtype."""
    dt = h.dtype
    gate_up, down = p["gate_up"], p["down"]
    gu = jnp.einsum("te,xem->txm", h, gate_up["kernel"].astype(dt)) + gate_up["bias"].astype(dt)
    y = jnp.einsum("txm,xme->txe", clamped_swiglu(gu, alpha, limit), down["kernel"].astype(dt))
    y = y + down["bias"].astype(dt)
    return jnp.einsum("txe,tx->te", y, weights.astype(dt))


class GptOssBlock(nn.Module):
    """One pre-norm layer. `moe_params` the whole `moe` group (broadcast), `sliding` and `pos`
    this layer's kind and its position in the group (scanned)."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x, cos, sin, moe_params, sliding, pos):
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        hd = cfg.head_dim
        h = GptOssRMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = Dense(dt, name="q")(h).reshape(b, s, cfg.num_heads, hd)
        k = Dense(dt, name="k")(h).reshape(b, s, cfg.num_kv_heads, hd)
        v = Dense(dt, name="v")(h).reshape(b, s, cfg.num_kv_heads, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        window = jnp.where(sliding, cfg.sliding_window or s, s)  # a full layer sees all of seq
        attn = sink_attention(q, k, v, table_param(self, "sinks"), hd**-0.5, window)
        x = x + Dense(dt, name="o")(attn.reshape(b, s, cfg.num_heads * hd))

        h = GptOssRMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x).reshape(b * s, -1)
        p = moe.layer_of(jax.tree.map(jnp.asarray, moe_params), pos)  # numpy params too
        w = route(h, p["router"], cfg.num_experts_per_tok)
        y = experts(h, w, p["experts"], cfg.swiglu_alpha, cfg.swiglu_limit)
        return x + y.reshape(b, s, -1), None


class GptOss(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: GptOssConfig)."""

    cfg: Any
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = config_rope_tables(cfg, tokens.shape[1])
        moe_params = TableGroup(name="moe")()
        sliding = jnp.asarray(cfg.sliding_layers, dtype=bool)
        _, pos = moe.layer_groups(cfg.moe_layers, cfg.num_layers)
        layers = stacked(GptOssBlock, cfg.num_layers, 3, n_per_layer=2)(cfg, dt, name="layers")
        x, _ = layers(x, cos, sin, moe_params, sliding, pos)
        x = GptOssRMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.tie_word_embeddings, dt)
        return logits.astype(jnp.float32)
