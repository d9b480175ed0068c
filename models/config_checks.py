"""Checks every family's config uses: positive sizes, positive floats, required HF keys, and
the RoPE keys of an HF `config.json`.

Each check raises `ConfigError` naming the config class (or the source file), the field, what
was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.errors import ConfigError


def check_positive(cfg: Any, names: tuple[str, ...]) -> None:
    """Each field in `names` of the dataclass `cfg` is a positive int (bools are not ints)."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(
                f"{type(cfg).__name__}.{name}: expected a positive int, found {value!r}"
            )


def as_floats(cfg: Any, names: tuple[str, ...]) -> None:
    """Each field in `names` of the frozen dataclass `cfg` is a positive number, stored as float."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(
                f"{type(cfg).__name__}.{name}: expected a positive number, found {value!r}"
            )
        object.__setattr__(cfg, name, float(value))


def require(d: Mapping[str, Any], keys: tuple[str, ...], source: str, arch: str) -> None:
    """Every key of `keys` is present (not null) in the config dict `d` read from `source`."""
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: {arch} config needs keys {list(keys)}; missing {missing}")


def hf_rope_theta(d: Mapping[str, Any], source: str) -> float:
    """rope_theta from v4 (`rope_theta`, `rope_scaling`) or v5 (`rope_parameters`) keys.

    Only the plain ("default") RoPE is implemented; any other `rope_type` is a ConfigError.
    """
    theta = d.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: {key} must be an object or null, found {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConfigError(
                f"{source}: {key} type {kind!r} is not implemented; only plain RoPE "
                f"(rope_scaling null / rope_type 'default') is supported"
            )
        if rope.get("rope_theta") is not None:
            theta = rope["rope_theta"]
    return float(10000.0 if theta is None else theta)
