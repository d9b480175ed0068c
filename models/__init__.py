"""Model families as plug-ins: each is a folder `models/<family>/` found through a registry.

A family folder holds `__init__.py` (`FAMILY = Family(...)`, see `models.family`), `config.py`
(the frozen config dataclass, its HF (and Meta) forms and rule variables; no JAX), `params.py`
(its param table, `models.table`: each param's path, shape, logical axes, HF name and layout op,
from which the shape and axes trees and the HF rules are generated; no JAX), `module.py` (the
Flax module, which creates its params from the table) and `dialects/` (how other frameworks
name and describe it: `models.dialect`). Nothing outside `models/` names a family; `models`
imports nothing from `hybridckpt` (its errors are `models.errors`, which `hybridckpt.errors`
re-exports).

Params are plain nested dicts of fp32 arrays, layers stacked on a leading `layers` axis (see
each family's `params.py` for its tree). `forward` holds no mesh code: jit it with sharded
params and XLA propagates the shardings.

Configs, `param_shape_tree`, `param_axes_tree`, rules and the registry need no JAX; the JAX
functions (`module`, `init_params`, `param_shapes`, `logical_axes`, `forward`, `loss`) live in
`models.jax_api` and are imported on first use, so `import models` stays light for conversions
that only move bytes.
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models.api import (
    config_from_dict,
    config_from_hf,
    config_from_meta_params,
    config_to_dict,
    config_to_hf,
    fit_to_hf_names,
    hf_name_fixes,
    hf_rules,
    param_axes_tree,
    param_groups_tree,
    param_shape_tree,
    rule_variables,
)
from hybridckpt.models.dialect import Dialect, dialects
from hybridckpt.models.family import (
    RULE_VARIABLES,
    Family,
    ModelConfig,
    families,
    family_named,
    family_of,
    speaking,
)
from hybridckpt.models.gpt2.config import GPT2Config
from hybridckpt.models.llama.config import LlamaConfig, meta_ffn_hidden_dim

_JAX_API = ("forward", "init_params", "logical_axes", "loss", "module", "param_shapes")

__all__ = [
    "RULE_VARIABLES",
    "Dialect",
    "Family",
    "GPT2Config",
    "LlamaConfig",
    "ModelConfig",
    "config_from_dict",
    "config_from_hf",
    "config_from_meta_params",
    "config_to_dict",
    "config_to_hf",
    "dialects",
    "families",
    "family_named",
    "family_of",
    "fit_to_hf_names",
    "hf_name_fixes",
    "hf_rules",
    "meta_ffn_hidden_dim",
    "param_axes_tree",
    "param_groups_tree",
    "param_shape_tree",
    "rule_variables",
    "speaking",
    *_JAX_API,
]


def __getattr__(name: str) -> Any:
    if name in _JAX_API:
        from hybridckpt.models import jax_api

        return getattr(jax_api, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
