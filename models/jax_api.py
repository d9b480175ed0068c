"""The JAX side of every family: the Flax module, init, forward, loss, abstract shapes and
logical axes. Imported on first use through `models` (a conversion that never computes imports
no JAX); every function builds the family's module named by `family_of(cfg).module`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import axes_of, next_token_loss, unboxed
from hybridckpt.models.family import ModelConfig, family_of

_INIT_TOKENS = (1, 1)  # shape of the dummy batch used to trace init


def module(cfg: ModelConfig, compute_dtype: Any = jnp.float32) -> nn.Module:
    """The Flax module of `cfg` computing in `compute_dtype` (params stay fp32)."""
    return family_of(cfg).flax_module()(cfg, compute_dtype)


def _boxed_init(cfg: ModelConfig, rng: jax.Array) -> Any:
    return module(cfg).init(rng, jnp.zeros(_INIT_TOKENS, jnp.int32))


_jit_boxed_init = jax.jit(_boxed_init, static_argnums=0)  # cached per (hashable) config


@lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig) -> Any:
    # the key is made inside the trace: a concrete `jax.random.key(0)` runs an XLA computation
    # (about 60 ms, the first in a process) that shapes never need
    return jax.eval_shape(lambda: _boxed_init(cfg, jax.random.key(0)))


def param_shapes(cfg: ModelConfig) -> dict:
    """Pytree of `jax.ShapeDtypeStruct` (fp32) of the params; allocates nothing."""
    return unboxed(_abstract(cfg))  # fresh dicts each call; the leaves are immutable


def logical_axes(cfg: ModelConfig) -> dict:
    """Pytree (same structure as the params) of logical-axis tuples, one name or None per dim."""
    return axes_of(_abstract(cfg))


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Fresh fp32 params: kernels/embeddings normal(0.02), norm scales 1, biases 0."""
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
