"""Qwen2-MoE in Flax linen, numerically like transformers' Qwen2MoeForCausalLM
(huggingface/transformers:src/transformers/models/qwen2_moe/modeling_qwen2_moe.py): the MoE model
of `models.mixtral.module` (Llama's attention, here with the table's q/k/v biases added before
RoPE; the MoE and dense groups outside the layer scan, `models.moe`) whose sparse MLP is
`Qwen2MoeSparseMoeBlock`'s:

  routed = sum over the top-k experts of w_e * down_e(silu(gate_e(x)) * up_e(x))
           (softmax router in fp32, top-k, renormalised only with norm_topk_prob, weights cast
           to the hidden dtype: `models.moe.sparse_moe`)
  out    = routed + sigmoid(x @ shared_gate) * down_s(silu(gate_s(x)) * up_s(x))

The config's `shared_expert` / `shared_expert_gated` (always true for the family) select this;
false (a test's switch) leaves the shared expert out, or adds it ungated.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from hybridckpt.models import moe
from hybridckpt.models.common import stacked
from hybridckpt.models.llama.module import RMSNorm
from hybridckpt.models.mixtral.module import Mixtral, attention


def shared_moe(cfg: Any, dt: Any, h: jax.Array, p: dict) -> jax.Array:
    """One MoE layer's MLP on h `[..., E]` from its params `p` (router, experts, shared,
    shared_gate): the routed experts plus the gated shared expert."""
    out = moe.sparse_moe(h, p, top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, dtype=dt,
                         weights_dtype=dt)  # fmt: skip
    if not cfg.shared_expert:
        return out
    shared = moe.swiglu(h, p["shared"], dt)
    if cfg.shared_expert_gated:
        shared = jax.nn.sigmoid(h.astype(dt) @ p["shared_gate"]["kernel"].astype(dt)) * shared
    return out + shared


class Qwen2MoeBlock(nn.Module):
    """One pre-norm layer: attention, then the MLP of the layer's group (`moe.group_mlp`)."""

    cfg: Any
    dtype: Any

    @nn.compact
    def __call__(self, x, cos, sin, moe_params, dense_params, is_moe, pos):
        cfg, dt = self.cfg, self.dtype
        x = attention(cfg, dt, x, cos, sin, None)
        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)

        def sparse(h, p):
            return shared_moe(cfg, dt, h, p)

        def swiglu(h, p):
            return moe.swiglu(h, p, dt)

        return x + moe.group_mlp(h, is_moe, pos, moe_params, dense_params, sparse, swiglu), None


class Qwen2Moe(Mixtral):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32 (cfg: Qwen2MoeConfig)."""

    def block(self) -> nn.Module:
        return stacked(Qwen2MoeBlock, self.cfg.num_layers, 4, 2)(
            self.cfg, self.dtype, name="layers"
        )
