"""The JAX side of every family: the Flax module, init, forward, loss, abstract shapes and
logical axes. Imported on first use through `models` (a conversion that never computes imports
no JAX). Shapes and axes come from the family's param table (nothing traced); init, forward and
loss build the family's module named by `family_of(cfg).module`."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.api import param_axes_tree, param_shape_tree
from hybridckpt.models.common import next_token_loss, unboxed
from hybridckpt.models.family import ModelConfig, family_of

_INIT_TOKENS = (1, 1)  # shape of the dummy batch init runs on


def module(cfg: ModelConfig, compute_dtype: Any = jnp.float32) -> nn.Module:
    """The Flax module of `cfg` computing in `compute_dtype` (params stay fp32)."""
    return family_of(cfg).flax_module()(cfg, compute_dtype)


def _boxed_init(cfg: ModelConfig, rng: jax.Array) -> Any:
    return module(cfg).init(rng, jnp.zeros(_INIT_TOKENS, jnp.int32))


_jit_boxed_init = jax.jit(_boxed_init, static_argnums=0)  # cached per (hashable) config


def param_shapes(cfg: ModelConfig) -> dict:
    """Pytree of `jax.ShapeDtypeStruct` (fp32) of the params, from the family's table; allocates
    and traces nothing."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32), param_shape_tree(cfg), is_leaf=_is_shape
    )


def logical_axes(cfg: ModelConfig) -> dict:
    """Pytree (same structure as the params) of logical-axis tuples, one name or None per dim
    (`models.param_axes_tree`: the family's table)."""
    return param_axes_tree(cfg)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Fresh fp32 params, each initialised as its table row says: kernels and embeddings
    normal(0.02), norm scales 1 (Gemma's zero-centred ones 0), biases 0."""
    return unboxed(_jit_boxed_init(cfg, rng))


def forward(
    cfg: ModelConfig, params: dict, tokens: jax.Array, *, compute_dtype: Any = jnp.float32
) -> jax.Array:
    """Causal LM logits `[batch, seq, vocab]` float32 for int tokens `[batch, seq]`."""
    return module(cfg, compute_dtype).apply({"params": params}, tokens)


def loss(
    cfg: ModelConfig, params: dict, tokens: jax.Array, *, compute_dtype: Any = jnp.float32
) -> jax.Array:
    """Mean next-token cross-entropy (fp32 scalar, nats) over tokens `[batch, seq]`."""
    return next_token_loss(forward(cfg, params, tokens, compute_dtype=compute_dtype), tokens)
