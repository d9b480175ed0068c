"""Values read from a checkpoint, checked for the type the code then uses them as.

A number, flag or list found in a file (an optimizer's `lr`, `betas`, a param group's `params`, a
step) is an attacker's like every other byte: `betas` may be a list of lists, `lr` a list, a
group's `params` an integer. Code that calls `float()`, `int()`, `len()` or indexes such a value
goes through these helpers first, which return it converted or raise one `FormatError`:
`{where}: {key}: expected {what}, found {value}` (the value cut short: `errors.short_repr`).

Accepted as numbers: Python ints and floats (never bools), numpy scalars, and one-element
tensors (torch keeps `lr` as a 0-d tensor when asked to: read as the element).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt.errors import FormatError, short_repr
from hybridckpt.lazy import LazyTensor


def _found(value: Any) -> str:
    kind = type(value).__name__
    return f"{short_repr(value, 60)} ({kind})"


def wrong(where: str, key: str, expected: str, value: Any) -> FormatError:
    """The one-line error for `key` of `where`: expected `expected`, found `value`."""
    return FormatError(f"{where}: {key}: expected {expected}, found {_found(value)}")


def _scalar(value: Any) -> Any:
    """A one-element tensor as its element (read), else `value` itself."""
    if isinstance(value, LazyTensor) and math.prod(value.shape) == 1 and np.dtype(value.dtype).kind in "iuf":
        return value.materialize().reshape(()).item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def number(value: Any, where: str, key: str) -> float:
    """`value` as a float: an int or float (not a bool), a numpy scalar or a one-element tensor."""
    v = _scalar(value)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise wrong(where, key, "a number", value)
    try:
        return float(v)
    except OverflowError:  # an int of 400 digits
        raise wrong(where, key, "a number that fits a float", value) from None


def integer(value: Any, where: str, key: str) -> int:
    """`value` as an int: an int (not a bool), an integral float, numpy integer or one-element tensor."""
    v = _scalar(value)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise wrong(where, key, "an integer", value)
    return v


def flag(value: Any, where: str, key: str) -> bool:
    """`value` as a bool: True or False only."""
    if not isinstance(value, (bool, np.bool_)):
        raise wrong(where, key, "true or false", value)
    return bool(value)


def sequence(value: Any, where: str, key: str) -> list:
    """`value` as a list: a list or a tuple."""
    if not isinstance(value, (list, tuple)):
        raise wrong(where, key, "a list", value)
    return list(value)


def numbers(value: Any, where: str, key: str, length: int | None = None) -> list[float]:
    """`value` as a list of floats (of `length` where given): `betas` is `[0.9, 0.999]`."""
    items = sequence(value, where, key)
    if length is not None and len(items) != length:
        raise wrong(where, key, f"a list of {length} numbers", value)
    out = []
    for v in items:
        v = _scalar(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise wrong(where, key, "a list of numbers", value)
        out.append(float(v))
    return out


def mapping(value: Any, where: str, key: str) -> Mapping:
    """`value` as a mapping (a dict)."""
    if not isinstance(value, Mapping):
        raise wrong(where, key, "a dict", value)
    return value
