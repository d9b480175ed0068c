"""ERNIE 4.5 MoE in Flax linen, numerically like transformers' Ernie4_5_MoeForCausalLM.

Rules from huggingface/transformers:src/transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py
(5.24): ERNIE 4.5's attention (`models.ernie4_5.module.attention`: interleaved RoPE, biases), then
on an MoE layer `Ernie4_5_MoeSparseMoeBlock` (`ernie_moe`: the router in fp32 as the config
docstring says, the experts as a dense dispatch `models.moe.experts_swiglu`, plus the shared
SwiGLU), else the dense SwiGLU (`swiglu_with_biases`). With `use_bias` the logits get
`lm_head.bias`, after the tied or untied head.

Params: the family's table (`models.ernie4_5_moe.params`): `layers` by the layer scan, the
groups `moe`, `mlp` and `mtp` whole (`models.common.TableGroup`; `mtp` only at init: the forward
pass does not use MTP, neither does transformers').
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import (
    Embed,
    TableGroup,
    has_param,
    output_logits,
    stacked,
    table_param,
)
from hybridckpt.models.ernie4_5.module import attention
from hybridckpt.models.ernie4_5_moe.config import Ernie45MoeConfig
from hybridckpt.models.llama.module import RMSNorm
from hybridckpt.models.moe import experts_swiglu, group_mlp, layer_groups
from hybridckpt.models.rope import config_rope_tables


def swiglu_with_biases(x: jax.Array, p: dict, dtype: Any) -> jax.Array:
    """`down(silu(gate(x)) * up(x))` of one layer's params `{gate,up,down}.{kernel, bias?}`."""
    def dense(h, q):
        y = h @ q["kernel"].astype(dtype)
        return y + q["bias"].astype(dtype) if "bias" in q else y

    x = x.astype(dtype)
    return dense(nn.silu(dense(x, p["gate"])) * dense(x, p["up"]), p["down"])


def route(cfg: Ernie45MoeConfig, x: jax.Array, kernel: jax.Array, bias: jax.Array, dtype: Any) -> jax.Array:
    """Combine weights `[tokens, experts]` (in `dtype`) of x `[tokens, embed]`:
    `Ernie4_5_MoeTopKRouter.forward` (kernel `[embed, experts]`, bias `[1, experts]`)."""
    probs = jax.nn.softmax(x.astype(jnp.float32) @ kernel.astype(jnp.float32), axis=-1)
    choice = probs + bias.reshape(-1).astype(jnp.float32) if cfg.routing_bias else probs
    chosen = jax.lax.top_k(choice, cfg.moe_k)[1]
    weights = jnp.take_along_axis(probs, chosen, axis=-1)
    weights = weights / jnp.maximum(weights.sum(axis=-1, keepdims=True), cfg.moe_norm_min)
    rows = jnp.arange(weights.shape[0])[:, None]
    return jnp.zeros_like(probs).at[rows, chosen].set(weights).astype(dtype)


def ernie_moe(cfg: Ernie45MoeConfig, dt: Any, x: jax.Array, p: dict) -> jax.Array:
    """One MoE layer's MLP of the normed `x` `[b, s, embed]` (params: one layer of `moe`)."""
    shape = x.shape
    h = x.reshape(-1, shape[-1]).astype(dt)
    weights = route(cfg, h, p["router"]["kernel"], p["router"]["bias"], dt)
    out = experts_swiglu(h, weights, p["experts"], dt)
    if "shared" in p:
        out = out + swiglu_with_biases(h, p["shared"], dt)
    return out.reshape(shape)


class MoeBlock(nn.Module):
    """One pre-norm layer: the attention, then the MLP of the layer's group (`group_mlp`)."""

    cfg: Ernie45MoeConfig
    dtype: Any

    @nn.compact
    def __call__(self, x, cos, sin, moe, mlp, is_moe, pos):
        cfg, dt = self.cfg, self.dtype
        x = attention(cfg, dt, x, cos, sin)
        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        y = group_mlp(h, is_moe, pos, moe, mlp, lambda h, p: ernie_moe(cfg, dt, h, p),
                      lambda h, p: swiglu_with_biases(h, p, dt))  # fmt: skip
        return x + y, None


class HeadBias(nn.Module):
    """`lm_head.bias` `[vocab]` of the table (a tied head has no kernel but keeps its bias)."""

    @nn.compact
    def __call__(self) -> jax.Array:
        return table_param(self, "bias")


class Ernie45Moe(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: Ernie45MoeConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        embed = Embed(dt, name="embed")
        x = embed(tokens)
        cos, sin = config_rope_tables(cfg, tokens.shape[1])
        moe = jax.tree.map(jnp.asarray, TableGroup(name="moe")())
        mlp = jax.tree.map(jnp.asarray, TableGroup(name="mlp")()) if cfg.dense_layers else None
        is_moe, pos = layer_groups(cfg.moe_layers, cfg.num_layers)
        x, _ = stacked(MoeBlock, cfg.num_layers, 4, 2)(cfg, dt, name="layers")(x, cos, sin, moe, mlp, is_moe, pos)
        if cfg.mtp_layers and self.is_initializing():  # the MTP modules' params: carried, not run
            TableGroup(name="mtp")()
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.tie_word_embeddings, dt)
        if cfg.tie_word_embeddings and has_param(self, "lm_head.bias"):  # untied: the Dense adds it
            logits = logits + HeadBias(name="lm_head")().astype(dt)
        return logits.astype(jnp.float32)
