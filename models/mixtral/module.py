"""Mixtral in Flax linen, numerically like transformers' MixtralForCausalLM; the same module
builds Qwen3-MoE (`models.qwen3_moe`) from the options its config gives.

Rules from huggingface/transformers:src/transformers/models/mixtral/modeling_mixtral.py:
Llama's attention, RoPE and RMSNorm (`models.llama.module`), a sliding window when the config
sets one (as Mistral: query i sees keys i - window < j <= i), and as MLP a sparse mixture of
experts (`models.moe.sparse_moe`: softmax router in fp32, top-k, renormalised; SwiGLU experts,
dense dispatch). Qwen3-MoE (qwen3_moe/modeling_qwen3_moe.py) adds per-head q/k RMSNorm before
RoPE (`cfg.qk_norm`), renormalises only with `norm_topk_prob` (`cfg.normalize_topk`), casts the
routing weights to the hidden dtype (`cfg.weights_in_hidden_dtype`) and has dense SwiGLU
layers where `mlp_only_layers` / `decoder_sparse_step` say (`cfg.dense_layers`).

Params: the family's table (`models.mixtral.params`, `models.qwen3_moe.params`): Llama's
attention and norms under `layers` (with qk_norm `{q,k}_norm.scale [L, hd]`), embed,
final_norm, lm_head (untied), and the MoE groups of `models.moe` outside the layer scan
(`moe.router`, `moe.experts.*`; with dense layers `mlp.*`), created whole by `TableGroup`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models import moe
from hybridckpt.models.common import (
    Dense,
    Embed,
    TableGroup,
    causal_attention,
    output_logits,
    stacked,
)
from hybridckpt.models.llama.module import Llama, RMSNorm, apply_rope
from hybridckpt.models.rope import config_rope_tables


def attention(cfg: Any, dt: Any, x: jax.Array, cos: jax.Array, sin: jax.Array, window: Any) -> jax.Array:
    """`x + o(attn(attn_norm(x)))`: Llama's GQA attention (with per-head q/k RMSNorm before
    RoPE when `cfg.qk_norm`), called inside a compact module (the params are its own)."""
    b, s, _ = x.shape
    hd = cfg.head_dim
    h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
    q = Dense(dt, name="q")(h).reshape(b, s, cfg.num_heads, hd)
    k = Dense(dt, name="k")(h).reshape(b, s, cfg.num_kv_heads, hd)
    v = Dense(dt, name="v")(h).reshape(b, s, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q = RMSNorm(cfg.rms_norm_eps, dt, name="q_norm")(q)
        k = RMSNorm(cfg.rms_norm_eps, dt, name="k_norm")(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    attn = causal_attention(q, k, v, hd**-0.5, window=window).reshape(b, s, cfg.num_heads * hd)
    return x + Dense(dt, name="o")(attn)


class MoeBlock(nn.Module):
    """One pre-norm layer: attention, then the MLP of the layer's group (`moe.group_mlp`)."""

    cfg: Any
    dtype: Any
    window: int | None = None

    @nn.compact
    def __call__(self, x, cos, sin, moe_params, dense_params, is_moe, pos):
        cfg, dt = self.cfg, self.dtype
        x = attention(cfg, dt, x, cos, sin, self.window)
        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        wdt = dt if cfg.weights_in_hidden_dtype else None

        def sparse(h, p):
            return moe.sparse_moe(
                h, p, top_k=cfg.num_experts_per_tok, normalize=cfg.normalize_topk, dtype=dt, weights_dtype=wdt
            )

        def swiglu(h, p):
            return moe.swiglu(h, p, dt)

        return x + moe.group_mlp(h, is_moe, pos, moe_params, dense_params, sparse, swiglu), None


class Mixtral(Llama):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: MixtralConfig or
    Qwen3MoeConfig)."""

    def sliding_window(self) -> int | None:
        return self.cfg.sliding_window

    def block(self) -> nn.Module:
        return stacked(MoeBlock, self.cfg.num_layers, 4, 2)(
            self.cfg, self.dtype, self.sliding_window(), name="layers"
        )

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = config_rope_tables(cfg, tokens.shape[1])
        moe_params = TableGroup(name="moe")()
        dense_params = TableGroup(name="mlp")() if cfg.dense_layers else None
        is_moe, pos = moe.layer_groups(cfg.moe_layers, cfg.num_layers)
        x, _ = self.block()(x, cos, sin, moe_params, dense_params, is_moe, pos)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.tie_word_embeddings, dt)
        return logits.astype(jnp.float32)
