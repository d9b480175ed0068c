"""Mixture-of-experts pieces shared by the MoE families (Mixtral, Qwen3-MoE, DeepSeek V3).

Param tree of an MoE model (fp32, kernels `[in, out]`; L = num_layers, Lm / Ld = the number of
MoE / dense-MLP layers, X = experts, E = embed (hidden), M = an expert's MLP width):

  layers.*                          attention and norms of every layer, `[L, ...]` (scanned)
  moe.router.kernel                 [Lm, E, X]      axes (layers, embed, None)
  moe.router.bias                   [Lm, X]         axes (layers, None)   (DeepSeek's
                                                    e_score_correction_bias, when a family has it)
  moe.experts.gate.kernel           [Lm, X, E, M]   axes (layers, experts, embed, mlp)
  moe.experts.up.kernel             [Lm, X, E, M]   axes (layers, experts, embed, mlp)
  moe.experts.down.kernel           [Lm, X, M, E]   axes (layers, experts, mlp, embed)
  moe.shared.{gate,up}.kernel       [Lm, E, Ms]     axes (layers, embed, mlp)  (DeepSeek shared
  moe.shared.down.kernel            [Lm, Ms, E]     axes (layers, mlp, embed)   experts: a SwiGLU)
  mlp.{gate,up}.kernel              [Ld, E, M]      axes (layers, embed, mlp)  (dense-MLP layers,
  mlp.down.kernel                   [Ld, M, E]      axes (layers, mlp, embed)   only when Ld > 0)

Position i of a group's leading axis is the i-th layer of that kind in layer order (the HF rules
stack them with index lists, `[$L in {moe_layers}]`). The rows are a family's table's
(`models.mlp_table` builds them); the groups are created whole, outside the layer scan, by
`models.common.TableGroup`. The `experts` axis maps to the `dp` mesh
axis by default (`hybridckpt.mesh`), so experts and their moments are split, never replicated.

Forward (`nn.scan` over all L layers, `stacked(..., n_per_layer=2)`): a family's block gets the
group params as broadcast inputs and, per layer, `is_moe` and `pos` (`layer_groups`); the MLP
half picks its group's layer `pos` (`group_mlp`).

Routing (`softmax_topk`): softmax over the experts of the router logits in fp32, the top-k
probabilities kept (`jax.lax.top_k`, as torch.topk: largest first), renormalised to sum 1 when
asked (Mixtral always, Qwen3-MoE with `norm_topk_prob`), zero for the other experts
(huggingface/transformers:src/transformers/models/mixtral/modeling_mixtral.py
`MixtralTopKRouter`, qwen3_moe/modeling_qwen3_moe.py `Qwen3MoeTopKRouter`).

Experts (`experts_swiglu`): a dense dispatch: every expert runs on every token, its output
`down(silu(gate(x)) * up(x))` weighted by the token's routing weight for it (zero off the top-k)
and summed. Exact (the unchosen experts add exact zeros); its memory is tokens x experts x
(2 * mlp + embed) activations in the compute dtype and its compute X / k times a sparse
dispatch's, fine at test sizes and for checking a conversion; not a training kernel.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = [
    "experts_swiglu",
    "group_mlp",
    "layer_groups",
    "layer_of",
    "softmax_topk",
    "sparse_moe",
    "swiglu",
]


def layer_groups(moe_layers: tuple[int, ...], num_layers: int) -> tuple[jax.Array, jax.Array]:
    """Per layer: `is_moe` (bool `[L]`) and `pos` (int32 `[L]`), its position in its group."""
    moe = set(moe_layers)
    dense = [i for i in range(num_layers) if i not in moe]
    pos = [sorted(moe).index(i) if i in moe else dense.index(i) for i in range(num_layers)]
    return jnp.array([i in moe for i in range(num_layers)]), jnp.array(pos, jnp.int32)


def layer_of(group: Any, pos: jax.Array) -> Any:
    """Layer `pos` of every leaf of a group's params (a dynamic index on the leading axis)."""
    return jax.tree.map(lambda a: a[pos], group)


def softmax_topk(logits: jax.Array, top_k: int, *, normalize: bool) -> jax.Array:
    """Routing weights `[tokens, experts]` fp32: softmax (fp32) of `logits`, the `top_k` largest
    kept (renormalised to sum 1 when `normalize`), zero elsewhere."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    vals, idx = jax.lax.top_k(probs, top_k)
    if normalize:
        vals = vals / jnp.sum(vals, axis=-1, keepdims=True)
    return jnp.sum(jax.nn.one_hot(idx, probs.shape[-1], dtype=vals.dtype) * vals[..., None], axis=-2)


def swiglu(x: jax.Array, p: dict, dtype: Any) -> jax.Array:
    """`down(silu(gate(x)) * up(x))` of one layer's SwiGLU params `{gate,up,down}.kernel`."""
    x = x.astype(dtype)
    g = x @ p["gate"]["kernel"].astype(dtype)
    u = x @ p["up"]["kernel"].astype(dtype)
    return (nn.silu(g) * u) @ p["down"]["kernel"].astype(dtype)


def experts_swiglu(x: jax.Array, weights: jax.Array, p: dict, dtype: Any) -> jax.Array:
    """Dense dispatch: x `[tokens, E]`, weights `[tokens, X]` (zero off the top-k), p one
    layer's `experts` params (`gate`/`up` `[X, E, M]`, `down` `[X, M, E]`) -> `[tokens, E]`.
    Each expert's output is multiplied by its weight (promoted as torch promotes: fp32 weights
    times a bf16 output compute in fp32) and the sum is cast to `dtype`."""
    x = x.astype(dtype)
    g = jnp.einsum("te,xem->txm", x, p["gate"]["kernel"].astype(dtype))
    u = jnp.einsum("te,xem->txm", x, p["up"]["kernel"].astype(dtype))
    y = jnp.einsum("txm,xme->txe", nn.silu(g) * u, p["down"]["kernel"].astype(dtype))
    return jnp.einsum("txe,tx->te", y, weights.astype(jnp.promote_types(weights.dtype, dtype))).astype(dtype)


def sparse_moe(
    x: jax.Array, p: dict, *, top_k: int, normalize: bool, dtype: Any, weights_dtype: Any = None
) -> jax.Array:
    """One MoE layer's MLP on x `[..., E]`: router `p["router"]["kernel"]`, `softmax_topk`,
    `experts_swiglu`. weights_dtype: cast the routing weights first (Qwen3-MoE casts them to
    the hidden dtype; Mixtral keeps fp32)."""
    shape = x.shape
    h = x.reshape(-1, shape[-1]).astype(dtype)
    logits = h @ p["router"]["kernel"].astype(dtype)
    w = softmax_topk(logits, top_k, normalize=normalize)
    if weights_dtype is not None:
        w = w.astype(weights_dtype)
    return experts_swiglu(h, w, p["experts"], dtype).reshape(shape)


def group_mlp(
    h: jax.Array,
    is_moe: jax.Array,
    pos: jax.Array,
    moe: dict | None,
    dense: dict | None,
    moe_fn: Any,
    dense_fn: Any,
) -> jax.Array:
    """The MLP of one scanned layer: `moe_fn(h, layer_of(moe, pos))` on an MoE layer, else
    `dense_fn(h, layer_of(dense, pos))`; a group that is None (no layer of that kind) is never
    traced, and with both present `jax.lax.cond` runs only the layer's own kind."""
    if dense is None:
        return moe_fn(h, layer_of(moe, pos))
    if moe is None:
        return dense_fn(h, layer_of(dense, pos))
    return jax.lax.cond(
        is_moe,
        lambda: moe_fn(h, layer_of(moe, pos)),
        lambda: dense_fn(h, layer_of(dense, pos)),
    )
