"""Rotary position embeddings (RoPE): the scaling an HF config carries, and the frequencies and
cos/sin tables each rope type gives, exactly as transformers computes them.

Reference: huggingface/transformers:src/transformers/modeling_rope_utils.py (the
`_compute_*_parameters` functions, `ROPE_INIT_FUNCTIONS`, `standardize_rope_params`) and
`LlamaRotaryEmbedding` in src/transformers/models/llama/modeling_llama.py.

## The scaling dict in an HF `config.json`
- transformers 4: `rope_theta` (top level) + `rope_scaling` (null, or an object with `rope_type`,
  or its legacy spelling `type`, and the type's parameters).
- transformers 5: `rope_parameters`, one object holding `rope_type`, `rope_theta` and the
  parameters; it writes only this key (and keeps a legacy `type` next to `rope_type`).
- Precedence as transformers 5 reads them (`convert_rope_params_to_dict`): a non-empty
  `rope_scaling` wins over `rope_parameters`; the dict's own `rope_theta` wins over the top-level
  one, which wins over 10000.
- `read_hf_rope` returns (theta, scaling): `scaling` is the chosen dict exactly as read,
  frozen (`Scaling`), or None for plain RoPE (no dict, or one holding only `rope_type: default`
  and `rope_theta`). `hf_rope_keys` writes all three keys back: `rope_theta`, `rope_scaling` (the
  dict as read, so a transformers-4 file comes back unchanged) and `rope_parameters` (what
  `standardize_rope_params` makes of it, so a file transformers 5 wrote comes back unchanged).

## Rope types (inv_freq `[head_dim / 2]` fp32; attention_scaling multiplies cos and sin)
- `default`: inv_freq = 1 / theta ** (arange(0, d, 2) / d); scaling 1.
- `linear` (`factor`): default / factor.
- `dynamic` (`factor`; NTK): for a forward pass over seq_len > max_position_embeddings, theta is
  replaced by theta * (factor * seq_len / max_pos - (factor - 1)) ** (d / (d - 2)) (computed in
  fp32, as transformers does with its tensor seq_len); otherwise default. transformers caches the
  grown frequencies across calls (a shorter call after a longer one reuses them until it drops
  below max_pos); this module is stateless: each forward uses its own seq_len.
- `llama3` (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`):
  wavelengths 2 pi / inv_freq above orig / low are divided by factor, below orig / high kept,
  between smoothly interpolated (none when high == low, as in Llama 4 Scout); scaling 1.
- `yarn` (`factor`, `original_max_position_embeddings`, optional `attention_factor`, `beta_fast`
  32, `beta_slow` 1, `mscale`, `mscale_all_dim`, `truncate` true): a linear ramp over the
  correction range blends interpolated (inv / factor) and extrapolated frequencies; scaling =
  `attention_factor`, else 0.1 * ln(factor) + 1 (or the mscale / mscale_all_dim ratio of those).
Other types (`longrope`, `proportional`, ...) and `partial_rotary_factor` != 1 are ConfigErrors.

JAX is imported only by `rope_tables` (the rest is numpy and plain Python, so configs stay light).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hybridckpt.models.errors import ConfigError

DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta

# A JSON object frozen to be hashable (configs are jax.jit cache keys): its (key, value) items
# sorted by key (JSON objects are unordered; writers such as ours sort keys), JSON arrays as
# tuples. `dataclasses.asdict` turns it into JSON arrays of pairs, which `freeze` reads back.
Scaling = tuple[tuple[str, Any], ...]

# rope_type -> (required keys, optional keys), beside rope_type / type / rope_theta /
# partial_rotary_factor (transformers' `_validate_<type>_rope_parameters`).
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}
_ALWAYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# Types whose missing `original_max_position_embeddings` transformers fills from the config.
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")

# ------------------------------------------------------------------------ the scaling dict


def _freeze_value(v: Any, where: str) -> Any:
    if isinstance(v, Mapping):
        raise ConfigError(f"{where}: expected a number, string, bool or list, found an object")
    if isinstance(v, list | tuple):
        return tuple(_freeze_value(x, where) for x in v)
    return v


def freeze(raw: Mapping[str, Any] | Sequence | None, where: str = "rope scaling") -> Scaling | None:
    """A rope dict (or the pairs `dataclasses.asdict` / our JSON made of one) as a `Scaling`."""
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, list | tuple) and all(
        isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) for p in raw
    ):
        items = [tuple(p) for p in raw]
    else:
        raise ConfigError(f"{where}: expected an object or null, found {raw!r}")
    frozen = ((k, _freeze_value(v, f"{where}.{k}")) for k, v in items)
    return tuple(sorted(frozen, key=lambda item: item[0]))


def _thaw_value(v: Any) -> Any:
    return [_thaw_value(x) for x in v] if isinstance(v, tuple) else v


def thaw(scaling: Scaling | Mapping | None) -> dict[str, Any] | None:
    """The JSON object (a fresh dict, arrays as lists) of a `Scaling`; None stays None."""
    if scaling is None:
        return None
    items = scaling.items() if isinstance(scaling, Mapping) else scaling
    return {k: _thaw_value(v) for k, v in items}


def rope_type(scaling: Scaling | Mapping | None) -> str:
    """The dict's `rope_type` (or legacy `type`); "default" for None."""
    d = thaw(scaling) or {}
    return d.get("rope_type", d.get("type", "default"))


def is_plain(raw: Mapping[str, Any]) -> bool:
    """True when the dict says nothing beyond plain RoPE: rope_type default and rope_theta."""
    return set(raw) <= {"rope_type", "rope_theta"} and raw.get("rope_type", "default") == "default"


def _number(d: Mapping, key: str, where: str, *, positive: bool = True) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or (positive and v <= 0):
        raise ConfigError(f"{where}: {key} must be a positive number, found {v!r}")
    return float(v)


def check_scaling(scaling: Scaling | Mapping | None, where: str) -> None:
    """ConfigError unless `scaling` is None or a rope dict of an implemented type with its keys.

    Messages name `where` (the file and key) and the rope type.
    """
    d = thaw(scaling)
    if d is None:
        return
    kind = rope_type(d)
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope_type {kind!r} is not implemented; expected one of {sorted(ROPE_TYPES)}"
        )
    if "rope_type" in d and "type" in d and d["rope_type"] != d["type"]:
        raise ConfigError(
            f"{where}: rope_type {d['rope_type']!r} disagrees with type {d['type']!r}"
        )
    required, optional = ROPE_TYPES[kind]
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(
            f"{where}: rope_type {kind!r} needs keys {list(required)}; missing {missing}"
        )
    unknown = sorted(set(d) - set(required) - set(optional) - set(_ALWAYS))
    if unknown:
        raise ConfigError(f"{where}: rope_type {kind!r} has unknown keys {unknown}")
    if "rope_theta" in d:
        _number(d, "rope_theta", where)
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{where}: partial_rotary_factor {d['partial_rotary_factor']!r} is not implemented; "
            f"expected 1.0 (RoPE over the whole head)"
        )
    for key in required + optional:
        if key == "truncate":
            if not isinstance(d.get(key, True), bool):
                raise ConfigError(f"{where}: truncate must be true or false, found {d[key]!r}")
        elif d.get(key) is not None or (key == "factor" and kind != "yarn"):
            _number(d, key, where)
    if kind == "llama3" and d["high_freq_factor"] < d["low_freq_factor"]:
        raise ConfigError(
            f"{where}: llama3 high_freq_factor must be at least low_freq_factor, found {d}"
        )


def read_hf_rope(d: Mapping[str, Any], source: str) -> tuple[float, Scaling | None]:
    """(rope_theta, scaling) of an HF `config.json` dict, v4 or v5 keys (see the module doc).

    `scaling` is the dict as read (frozen), None for plain RoPE; ConfigError names `source`, the
    key and the rope type when the dict is malformed or its type is not implemented.
    """
    chosen, key = None, None
    for name in ("rope_scaling", "rope_parameters"):
        raw = d.get(name)
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: {name} must be an object or null, found {raw!r}")
        if raw and chosen is None:
            chosen, key = raw, name
    theta = d.get("rope_theta")
    if chosen is not None and chosen.get("rope_theta") is not None:
        theta = chosen["rope_theta"]
    theta = DEFAULT_THETA if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta must be a positive number, found {theta!r}")
    if chosen is None or is_plain(chosen):
        return float(theta), None
    scaling = freeze(chosen, f"{source}: {key}")
    check_scaling(scaling, f"{source}: {key}")
    return float(theta), scaling


def rope_parameters(
    theta: float, scaling: Scaling | Mapping | None, max_position_embeddings: int | None
) -> dict[str, Any]:
    """transformers 5's `rope_parameters` for this RoPE: the dict with `rope_type`, `rope_theta`
    (and, for llama3 / yarn, `original_max_position_embeddings`) filled in where absent, as
    `standardize_rope_params` does."""
    d = thaw(scaling) or {}
    d.setdefault("rope_type", d.get("type", "default"))
    d.setdefault("rope_theta", theta)
    if d["rope_type"] in _NEEDS_ORIGINAL:
        d.setdefault("original_max_position_embeddings", max_position_embeddings)
    return d


def hf_rope_keys(
    theta: float, scaling: Scaling | Mapping | None, max_position_embeddings: int
) -> dict[str, Any]:
    """The RoPE keys of an HF `config.json` (both forms; see the module doc)."""
    return {
        "rope_theta": theta,
        "rope_scaling": thaw(scaling),
        "rope_parameters": rope_parameters(theta, scaling, max_position_embeddings),
    }


def check_config_rope(
    theta: float, scaling: Scaling | Mapping | None, where: str
) -> Scaling | None:
    """A config's (rope_theta, rope_scaling) fields checked; returns the scaling frozen, None
    when it says nothing beyond plain RoPE of `theta` (for the config's __post_init__).

    The dict's own rope_theta, when present, must equal `theta`.
    """
    frozen = freeze(scaling, f"{where}.rope_scaling")
    check_scaling(frozen, f"{where}.rope_scaling")
    own = dict(frozen or ()).get("rope_theta")
    if own is not None and float(own) != theta:
        raise ConfigError(
            f"{where}: rope_scaling rope_theta {own!r} disagrees with rope_theta {theta!r}"
        )
    if frozen is not None and is_plain(dict(frozen)):
        return None
    return frozen


# ------------------------------------------------------------------------------ frequencies

_f32 = np.float32


def _rcp(x: np.ndarray) -> np.ndarray:
    """`scalar / tensor` in torch is `tensor.reciprocal() * scalar`: the reciprocal, in fp32."""
    return (_f32(1.0) / x).astype(np.float32)


def _pow(base: Any, exponent: Any) -> Any:
    """fp32 base ** fp32 exponent, rounded once from fp64 (as close to torch's fp32 pow as we
    measured: numpy's float32 pow is often 1 ulp away from it, this rarely)."""
    return (np.float64(_f32(base)) ** np.asarray(exponent, np.float32).astype(np.float64)).astype(
        np.float32
    )


def _default_inv_freq(base: Any, dim: int) -> np.ndarray:
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / _f32(dim)
    return _rcp(_pow(base, exponent))


def _dynamic_base(theta: float, d: Mapping, dim: int, seq_len: int | None, max_pos: int) -> Any:
    factor = d["factor"]
    if seq_len is None or seq_len <= max_pos:  # transformers' init value, in Python floats
        return theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    # a longer forward: transformers recomputes with seq_len a tensor, so all of this is fp32
    ratio = _f32(factor) * _f32(seq_len) / _f32(max_pos) - _f32(factor - 1)
    return _f32(theta) * _pow(ratio, dim / (dim - 2))


def _llama3(inv_freq: np.ndarray, d: Mapping) -> np.ndarray:
    factor, low, high = d["factor"], d["low_freq_factor"], d["high_freq_factor"]
    old_context_len = d["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = _rcp(inv_freq) * _f32(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / _f32(factor), inv_freq)
    with np.errstate(divide="ignore", invalid="ignore"):  # high == low (Llama 4 Scout): no medium band
        smooth = (_rcp(wavelen) * _f32(old_context_len) - _f32(low)) / _f32(high - low)
        smoothed = (_f32(1) - smooth) * scaled / _f32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_attention_factor(d: Mapping, factor: float) -> float:
    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if d.get("attention_factor") is not None:
        return float(d["attention_factor"])
    mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return float(get_mscale(factor))


def _yarn(theta: float, d: Mapping, dim: int, max_pos: int | None) -> tuple[np.ndarray, float]:
    original = d["original_max_position_embeddings"]
    factor = d.get("factor")
    if factor is None:
        factor = max_pos / original
    attention_factor = _yarn_attention_factor(d, factor)
    beta_fast = d.get("beta_fast") or 32
    beta_slow = d.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if d.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp

    exponent = np.arange(0, dim, 2).astype(np.float32) / _f32(dim)
    pos_freqs = _pow(theta, exponent)
    extrapolation = _rcp(pos_freqs)
    interpolation = _rcp(_f32(factor) * pos_freqs)
    ramp = (np.arange(dim // 2, dtype=np.float32) - _f32(low)) / _f32(high - low)
    extrapolation_factor = _f32(1) - np.clip(ramp, _f32(0), _f32(1))
    inv_freq = (
        interpolation * (_f32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    )
    return inv_freq.astype(np.float32), attention_factor


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: Scaling | Mapping | None = None,
    seq_len: int | None = None,
    *,
    max_position_embeddings: int | None = None,
) -> tuple[np.ndarray, float]:
    """(inv_freq `[head_dim // 2]` fp32, attention_scaling) of one rope type, as transformers.

    seq_len: the length of the forward pass (only `dynamic` uses it); max_position_embeddings:
    the config's (needed by `dynamic`, and by llama3 / yarn dicts lacking
    `original_max_position_embeddings`).
    """
    check_scaling(scaling, "rope scaling")
    kind = rope_type(scaling)
    d = rope_parameters(theta, scaling, max_position_embeddings)
    base = float(d["rope_theta"])
    needs_max = kind == "dynamic" or (kind == "yarn" and d.get("factor") is None)
    if (needs_max or "original_max_position_embeddings" in d) and not max_position_embeddings:
        if needs_max or d["original_max_position_embeddings"] is None:
            raise ConfigError(f"rope_type {kind!r} needs max_position_embeddings")
    if kind == "default":
        return _default_inv_freq(base, head_dim), 1.0
    if kind == "linear":
        return (_default_inv_freq(base, head_dim) / _f32(d["factor"])).astype(np.float32), 1.0
    if kind == "dynamic":
        base = _dynamic_base(base, d, head_dim, seq_len, max_position_embeddings)
        return _default_inv_freq(base, head_dim), 1.0
    if kind == "llama3":
        return _llama3(_default_inv_freq(base, head_dim), d), 1.0
    return _yarn(base, d, head_dim, max_position_embeddings)


def rope_tables(
    seq: int,
    head_dim: int,
    theta: float,
    scaling: Scaling | Mapping | None = None,
    *,
    max_position_embeddings: int | None = None,
) -> tuple[Any, Any]:
    """cos, sin `[seq, head_dim]` fp32 jax arrays for positions 0..seq-1.

    As `LlamaRotaryEmbedding.forward`: angles = position * inv_freq in fp32, repeated over both
    halves, then cos and sin times attention_scaling (still fp32; callers cast to their dtype).
    """
    import jax.numpy as jnp

    inv_freq, attention_scaling = rope_frequencies(
        head_dim, theta, scaling, seq, max_position_embeddings=max_position_embeddings
    )
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos, sin


def config_rope_tables(cfg: Any, seq: int) -> tuple[Any, Any]:
    """`rope_tables` of a config with `head_dim`, `rope_theta`, `max_position_embeddings` and
    (optionally) `rope_scaling` fields, as the Llama-like families carry them."""
    return rope_tables(
        seq,
        cfg.head_dim,
        cfg.rope_theta,
        getattr(cfg, "rope_scaling", None),
        max_position_embeddings=cfg.max_position_embeddings,
    )
