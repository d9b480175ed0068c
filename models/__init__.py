"""Flax model specs: Llama and GPT-2 families as plain pytrees with logical axis names.

Every function dispatches on the config type. Params are plain nested dicts of fp32 arrays,
layers stacked on a leading `layers` axis (see `models.llama` / `models.gpt2` for the trees).
`forward` holds no mesh code: jit it with sharded params and XLA propagates the shardings.

Configs and `param_shape_tree` need no JAX; the JAX functions (`module`, `init_params`,
`param_shapes`, `logical_axes`, `forward`, `loss`) live in `models.jax_api` and are imported on
first use, so `import models` stays light for conversions that only move bytes.
"""

from __future__ import annotations

from typing import Any

from models.config import (
    GPT2Config,
    LlamaConfig,
    ModelConfig,
    config_from_dict,
    config_from_hf,
    config_from_meta_params,
    config_to_dict,
    config_to_hf,
    meta_ffn_hidden_dim,
)
from models.shapes import param_shape_tree

_JAX_API = ("forward", "init_params", "logical_axes", "loss", "module", "param_shapes")

__all__ = [
    "GPT2Config",
    "LlamaConfig",
    "ModelConfig",
    "config_from_dict",
    "config_from_hf",
    "config_from_meta_params",
    "config_to_dict",
    "config_to_hf",
    "meta_ffn_hidden_dim",
    "param_shape_tree",
    *_JAX_API,
]


def __getattr__(name: str) -> Any:
    if name in _JAX_API:
        from models import jax_api

        return getattr(jax_api, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
