"""Qwen3-Next in Flax linen, numerically like transformers' Qwen3NextForCausalLM
(huggingface/transformers:src/transformers/models/qwen3_next/modeling_qwen3_next.py).

Every layer: x + mixer(norm(x)), then x + mlp(norm(x)), the norms zero-centred: RMSNorm with fp32
statistics times (1 + w), then cast (`Qwen3NextRMSNorm`; also the q/k norms and the final one).
- mixer of a "linear_attention" layer: the gated delta net (`models.qwen3_next.delta`);
- mixer of a "full_attention" layer: `q_proj` gives per head [q_h; gate_h]; q and k per-head
  (1+w)-normalised; RoPE on the first `rotary_dim` = head_dim * partial_rotary_factor of each
  head (half-split within it, the rest passed); GQA causal softmax attention (scale
  head_dim^-1/2); the output times sigmoid(gate), then `o_proj`;
- mlp: the sparse mixture (`models.moe.sparse_moe`: softmax router, top-k renormalised with
  `norm_topk_prob`, weights cast to the hidden dtype) plus the shared SwiGLU expert times
  sigmoid(`shared_expert_gate`); dense SwiGLU on `mlp_only_layers`.
The layers differ in kind, so the forward is a Python loop over them (unrolled under jit), each
taking its slice of its group (`attn`, `linear`, `moe`, `mlp`: stacked over that kind's layers
in layer order, the leading axis sharded over pp like `layers`). Params: `models.qwen3_next.params`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models import moe
from hybridckpt.models.common import Embed, TableGroup, causal_attention, output_logits
from hybridckpt.models.llama.module import apply_rope
from hybridckpt.models.qwen3_next.config import Qwen3NextConfig
from hybridckpt.models.qwen3_next.delta import gated_delta_net
from hybridckpt.models.rope import rope_tables


def zero_centred_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """(x fp32 normalised) * (1 + w fp32), cast to x's dtype (`Qwen3NextRMSNorm`)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_attention(
    cfg: Any, dt: Any, x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array
) -> jax.Array:
    """One full-attention layer's output `[b, s, E]` from its params `p` (`attn.*`, one layer)."""
    b, s, _ = x.shape
    nh, hd, rd, eps = cfg.num_heads, cfg.head_dim, cfg.rotary_dim, cfg.rms_norm_eps
    qg = (x @ p["q"]["kernel"].astype(dt)).reshape(b, s, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, s, nh * hd)
    k = (x @ p["k"]["kernel"].astype(dt)).reshape(b, s, cfg.num_kv_heads, hd)
    v = (x @ p["v"]["kernel"].astype(dt)).reshape(b, s, cfg.num_kv_heads, hd)
    q, k = (
        zero_centred_norm(q, p["q_norm"]["scale"], eps),
        zero_centred_norm(k, p["k_norm"]["scale"], eps),
    )

    def rope(t: jax.Array) -> jax.Array:
        return jnp.concatenate([apply_rope(t[..., :rd], cos, sin), t[..., rd:]], axis=-1)

    q, k = rope(q), rope(k)
    rep = nh // cfg.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    attn = causal_attention(q, k, v, hd**-0.5).reshape(b, s, nh * hd)
    return output_gate(attn, gate) @ p["o"]["kernel"].astype(dt)


def output_gate(attn: jax.Array, gate: jax.Array) -> jax.Array:
    """The attention output times sigmoid(gate) (per value, before `o_proj`)."""
    return attn * jax.nn.sigmoid(gate)


def shared_moe(cfg: Any, dt: Any, h: jax.Array, p: dict) -> jax.Array:
    """The sparse mixture plus the sigmoid-gated shared expert, h `[b, s, E]`."""
    routed = moe.sparse_moe(h, p, top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, dtype=dt,
                            weights_dtype=dt)  # fmt: skip
    return routed + shared_gate(h, p, dt) * moe.swiglu(h, p["shared"], dt)


def shared_gate(h: jax.Array, p: dict, dt: Any) -> jax.Array:
    """sigmoid(`shared_expert_gate`(h)) `[b, s, 1]`: how much of the shared expert each token takes."""
    return jax.nn.sigmoid(h @ p["shared_gate"]["kernel"].astype(dt))


class Qwen3Next(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: Qwen3NextConfig)."""

    cfg: Qwen3NextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt, eps = self.cfg, self.dtype, self.cfg.rms_norm_eps
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        names = ["layers", "attn", "linear", "moe"] + (["mlp"] if cfg.dense_layers else [])
        groups = {name: TableGroup(name=name)() for name in names}
        cos, sin = rope_tables(tokens.shape[1], cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                               max_position_embeddings=cfg.max_position_embeddings)  # fmt: skip

        def slot(*kinds: tuple[str, tuple[int, ...]]) -> dict[int, tuple[str, int]]:
            """layer -> (its group, its position in the group)."""
            return {layer: (group, i) for group, layers in kinds for i, layer in enumerate(layers)}

        mixers = slot(("attn", cfg.attention_layers), ("linear", cfg.linear_layers))
        mlps = slot(("moe", cfg.moe_layers), ("mlp", cfg.dense_layers))
        for layer in range(cfg.num_layers):
            norms = jax.tree.map(lambda a, i=layer: a[i], groups["layers"])
            mixer, i = mixers[layer]
            p = jax.tree.map(lambda a, i=i: a[i], groups[mixer])
            h = zero_centred_norm(x, norms["attn_norm"]["scale"], eps)
            x = x + (
                gated_attention(cfg, dt, h, p, cos, sin)
                if mixer == "attn"
                else gated_delta_net(cfg, dt, h, p)
            )
            mlp, i = mlps[layer]
            p = jax.tree.map(lambda a, i=i: a[i], groups[mlp])
            h = zero_centred_norm(x, norms["mlp_norm"]["scale"], eps)
            x = x + (shared_moe(cfg, dt, h, p) if mlp == "moe" else moe.swiglu(h, p, dt))
        x = zero_centred_norm(x, TableGroup(name="final_norm")()["scale"], eps)
        return output_logits(x, embed, cfg.tie_word_embeddings, dt).astype(jnp.float32)
