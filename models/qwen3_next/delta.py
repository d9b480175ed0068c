"""The gated delta net of Qwen3-Next (its linear-attention layers) in JAX, as transformers 5.24
computes it (huggingface/transformers:src/transformers/models/qwen3_next/modeling_qwen3_next.py
`Qwen3NextGatedDeltaNet.forward` with no cache, `causal_conv1d_fn`, `l2norm`,
`torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`, `Qwen3NextRMSNormGated`).

Shapes: x `[batch, seq, E]`; NK key heads of width DK, NV value heads of width DV, r = NV / NK.
1. `in_proj_qkvz` gives per key head [q (DK); k (DK); v (r DV); z (r DV)], `in_proj_ba` per key
   head [b (r); a (r)]; value head j belongs to key head j // r.
2. The channels [q of every head | k | v] (CD = 2 NK DK + NV DV) pass a depthwise causal conv
   (width K, weight `[CD, 1, K]`: out[t, c] = sum_i w[c, i] x[t - K + 1 + i, c], zeros before
   the start), then SiLU.
3. beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias) (fp32, log decay <= 0).
4. The delta rule, fp32 (`delta_rule`): q, k repeated to NV heads, L2-normalised
   (x rsqrt(sum x^2 + 1e-6)), q scaled by DK^-1/2; state S `[batch, NV, DK, DV]` from zero; per
   token S <- S exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q. Written as a `lax.scan`
   over the tokens: transformers' chunked kernel (what its forward runs) computes the same
   recurrence in another order, equal up to fp32 rounding.
5. Gated RMSNorm per value head over DV: w * normalise(o) (statistics fp32, cast to the compute
   dtype first), times silu(z) in fp32, cast back; then `out_proj` over NV DV.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2, -1) + eps), as transformers' `l2norm` (fp32 in, fp32 out)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> jax.Array:
    """The gated delta rule with q/k L2-normalised: q, k `[b, s, NK, DK]`, v `[b, s, NV, DV]`,
    g, beta `[b, s, NV]` -> `[b, s, NV, DV]` in q's dtype (computed in fp32)."""
    dtype, nk, nv = q.dtype, q.shape[2], v.shape[2]
    q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)
    q, k, v, g, beta = (t.astype(jnp.float32) for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        state = state * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    b, _, h, dk = k.shape
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    _, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 1, 0) for t in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1).astype(dtype)


def causal_conv(x: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv of x `[b, s, C]` with weight `[C, 1, K]`, then SiLU."""
    w = weight[:, 0, :].astype(x.dtype)
    width = w.shape[-1]
    padded = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    seq = x.shape[1]
    out = sum(padded[:, i : i + seq, :] * w[:, i] for i in range(width))
    return nn.silu(out)


def split_heads(cfg: Any, qkvz: jax.Array, ba: jax.Array) -> tuple[jax.Array, ...]:
    """q, k `[b, s, NK, DK]`, v, z `[b, s, NV, DV]`, b, a `[b, s, NV]` of the projections
    `[b, s, QKVZ]` and `[b, s, BA]`, each grouped per key head (`fix_query_key_value_ordering`)."""
    b, s, _ = qkvz.shape
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    qkvz = qkvz.reshape(b, s, nk, 2 * dk + 2 * r * dv)
    ba = ba.reshape(b, s, nk, 2 * r)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(b, s, nv, dv)
    z = qkvz[..., 2 * dk + r * dv :].reshape(b, s, nv, dv)
    return q, k, v, z, ba[..., :r].reshape(b, s, nv), ba[..., r:].reshape(b, s, nv)


def log_decay(a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """g = -exp(A_log) softplus(a + dt_bias), fp32 `[b, s, NV]` (the state's log decay)."""
    return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    )


def gated_rms_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """w * normalise(o) (fp32 statistics, cast to o's dtype) times silu(z) in fp32, cast back
    (`Qwen3NextRMSNormGated`): per value head, over DV."""
    o32 = o.astype(jnp.float32)
    normed = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)).astype(
        o.dtype
    )
    return (w.astype(o.dtype) * normed * nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def gated_delta_net(cfg: Any, dt: Any, x: jax.Array, p: dict) -> jax.Array:
    """One linear-attention layer's output `[b, s, E]` (module doc) from its params `p`
    (`models.qwen3_next.params` `linear.*`, one layer)."""
    b, s, _ = x.shape
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q, k, v, z, beta_in, a = split_heads(
        cfg, x @ p["qkvz"]["kernel"].astype(dt), x @ p["ba"]["kernel"].astype(dt)
    )
    mixed = jnp.concatenate(
        [q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], axis=-1
    )
    mixed = causal_conv(mixed, p["conv"]["weight"])
    q = mixed[..., : nk * dk].reshape(b, s, nk, dk)
    k = mixed[..., nk * dk : 2 * nk * dk].reshape(b, s, nk, dk)
    v = mixed[..., 2 * nk * dk :].reshape(b, s, nv, dv)
    beta = jax.nn.sigmoid(beta_in)
    g = log_decay(a, p["A_log"], p["dt_bias"])
    o = gated_rms_norm(delta_rule(q, k, v, g, beta), z, p["norm"]["scale"], cfg.rms_norm_eps)
    return o.reshape(b, s, nv * dv) @ p["out"]["kernel"].astype(dt)
