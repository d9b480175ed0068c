"""The JAX-free functions of `models`: each picks the family through the registry
(`models.family`) and calls it, so none names a family.

A family is picked by the config's type (`family_of`), an HF `config.json`'s `architectures` or
`model_type` (`config_from_hf`), or the `"family"` of our own JSON (`config_from_dict`).

Our own JSON (`config_to_dict` / `config_from_dict`), stored in trainer state and shown by
`inspect --json`: the config dataclass's fields plus `"family"`, RoPE scaling dicts as objects
(stores written before hold them as arrays of pairs: both are read); unknown families or keys are a
ConfigError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.family import (
    RULE_VARIABLES,
    ModelConfig,
    families,
    family_for_hf,
    family_named,
    family_of,
)


def config_from_hf(d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Our config from an HF `config.json` dict; `source` names the file in error messages."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, found {type(d).__name__}")
    return family_for_hf(d, source).config_from_hf(d, source)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back.

    `torch_dtype` / `dtype` are left to the caller (they describe the saved weights).
    """
    return family_of(cfg).config_to_hf(cfg)


def config_from_meta_params(
    d: Mapping[str, Any], vocab_size: int | None = None, *, source: str = "params.json"
) -> ModelConfig:
    """Our config (untied) from Meta's `params.json`, read by the family that reads it (Llama).

    vocab_size: required when params.json has -1 (Llama 1/2: the tokenizer's size); when both
    are given they must agree.
    """
    readers = [fam for fam in families().values() if fam.config_from_meta is not None]
    if len(readers) != 1:
        names = [fam.name for fam in readers]
        raise ConfigError(f"{source}: expected one family reading Meta params.json, found {names}")
    return readers[0].config_from_meta(d, vocab_size, source)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """JSON-able dict: the dataclass fields plus "family"; a RoPE scaling (`models.rope.Scaling`,
    frozen pairs) as the JSON object it was read from."""
    from hybridckpt.models.rope import thaw

    fam = family_of(cfg)
    out = {"family": fam.name, **dataclasses.asdict(cfg)}
    for f in dataclasses.fields(cfg):
        if "Scaling" in str(f.type) and getattr(cfg, f.name) is not None:
            out[f.name] = thaw(getattr(cfg, f.name))
    return out


def config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Inverse of `config_to_dict`; unknown families or keys are a ConfigError."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"model config: expected a JSON object, found {type(d).__name__}")
    family = d.get("family")
    cls = family_named(family).config_cls
    fields = {f.name for f in dataclasses.fields(cls)}
    rest = {k: v for k, v in d.items() if k != "family"}
    unknown = sorted(set(rest) - fields)
    if unknown:
        raise ConfigError(
            f"model config ({family}): unknown keys {unknown}; expected {sorted(fields)}"
        )
    try:
        return cls(**rest)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"model config ({family}): {e}") from None


def param_shape_tree(cfg: ModelConfig) -> dict:
    """Nested dicts (the params' structure) of shape tuples; every param is fp32.

    The tree of the family's param table (`models.table`), which the Flax module's init builds
    (kernels `[in, out]`, per-layer params stacked on a leading `[L]` axis): nothing is traced
    or allocated.
    """
    return family_of(cfg).shape_tree(cfg)


def param_axes_tree(cfg: ModelConfig) -> dict:
    """Nested dicts (the `param_shape_tree` structure) of logical-axis tuples, one name or None
    per dim, from the family's param table (what the Flax module annotates; no JAX)."""
    return family_of(cfg).axes_tree(cfg)


def param_groups_tree(cfg: ModelConfig) -> dict:
    """Nested dicts (the `param_shape_tree` structure) of per-dim tuples: the `models.table.Groups`
    (what, count) a dim is made of (q heads, kv heads, experts), None for the others. A mesh axis
    splits a grouped dim only between groups (`hybridckpt.mesh.partition_spec`)."""
    return family_of(cfg).groups_tree(cfg)


def rule_variables(cfg: ModelConfig) -> dict[str, Any]:
    """Variables a rules text may use, from a model config: at least `RULE_VARIABLES`
    (num_heads, num_kv_heads, head_dim, hidden_size, vocab_size, num_layers, intermediate_size,
    tied)."""
    fam = family_of(cfg)
    variables = fam.rule_variables(cfg)
    missing = [k for k in RULE_VARIABLES if k not in variables]
    if missing:
        raise ConfigError(f"family {fam.name!r}: rule_variables lacks {missing}")
    return variables


def hf_rules(cfg: ModelConfig) -> tuple[str, str]:
    """(text, origin) of the rules from HF names to the params tree of `cfg`'s family, generated
    from its param table; origin names the table in error messages ("models/llama/params.py
    table": line N of the text is row N)."""
    return family_of(cfg).hf_rules()


def fit_to_hf_names(cfg: ModelConfig, names: Collection[str]) -> ModelConfig:
    """`cfg` as the checkpoint whose HF tensor names are `names` has it: parts a config.json
    announces but a checkpoint may leave out (DeepSeek V3's MTP modules, which transformers
    drops on save) counted from the names; `cfg` itself for most families."""
    return family_of(cfg).fit_to_hf_names(cfg, names)


def hf_name_fixes(cfg: ModelConfig, names: Collection[str]) -> str:
    """A rules text renaming alternate HF spellings among `names` (the tensor names of an HF
    file) to the ones `hf_rules(cfg)` expects; "" when they need none."""
    return family_of(cfg).hf_name_fixes(names)
