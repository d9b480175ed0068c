"""Checks every family's config uses: positive sizes, positive floats, required HF keys, and
the plain RoPE of an HF `config.json` (scaled RoPE: `models.rope`); for the multimodal wrappers,
a field one of its allowed values and the kept config.json keys a JSON object.

Each check raises `ConfigError` naming the config class (or the source file), the field, what
was expected and what was found.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.rope import read_hf_rope, rope_type

MAX_SIZE = 1 << 31  # the largest size field a config may hold (vocab, hidden, layers, heads...): a
# config is untrusted data, and shapes, loops and rule variables are computed from these


def check_positive(cfg: Any, names: tuple[str, ...]) -> None:
    """Each field in `names` of the dataclass `cfg` is a positive int (bools are not ints) of
    at most MAX_SIZE."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
            raise ConfigError(
                f"{type(cfg).__name__}.{name}: expected a positive int of at most {MAX_SIZE}, "
                f"found {value!r:.60}"
            )


def as_floats(cfg: Any, names: tuple[str, ...]) -> None:
    """Each field in `names` of the frozen dataclass `cfg` is a positive number, stored as float."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e300:
            raise ConfigError(
                f"{type(cfg).__name__}.{name}: expected a positive finite number, found {value!r:.60}"
            )
        object.__setattr__(cfg, name, float(value))


def check_choice(cfg: Any, name: str, allowed: tuple[Any, ...]) -> None:
    """The field `name` of the dataclass `cfg` is one of `allowed` (a name prefix, a head name)."""
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(f"{type(cfg).__name__}.{name}: {value!r:.80}; expected one of {list(allowed)}")


def check_json_object(cfg: Any, name: str = "hf_rest") -> None:
    """The field `name` of the dataclass `cfg` is the JSON text of an object (a wrapper config's
    config.json keys kept as read)."""
    where = f"{type(cfg).__name__}.{name}"
    try:
        value = json.loads(getattr(cfg, name))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a JSON object, found {type(value).__name__}")


def require(d: Mapping[str, Any], keys: tuple[str, ...], source: str, arch: str) -> None:
    """Every key of `keys` is present (not null) in the config dict `d` read from `source`."""
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: {arch} config needs keys {list(keys)}; missing {missing}")


def hf_rope_theta(d: Mapping[str, Any], source: str) -> float:
    """rope_theta of an HF config dict for a family that carries no RoPE scaling.

    Read by `models.rope.read_hf_rope` (v4 `rope_theta` + `rope_scaling` or v5
    `rope_parameters`); a scaling dict (any rope_type but plain "default") is a ConfigError here.
    Families whose config carries the scaling call `read_hf_rope` themselves.
    """
    theta, scaling = read_hf_rope(d, source)
    if scaling is not None:
        raise ConfigError(
            f"{source}: rope_type {rope_type(scaling)!r} is not supported by this family; "
            f"only plain RoPE (rope_scaling null / rope_type 'default') is"
        )
    return theta
