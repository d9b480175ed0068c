"""numpy arrays, dtypes and scalars in a pickle, rebuilt from checked state only.

numpy pickles (numpy/numpy: numpy/_core/src/multiarray/methods.c `array_reduce`,
descriptor.c `arraydescr_reduce`):
- an array is `numpy[._core|.core].multiarray._reconstruct(numpy.ndarray, (0,), b'b')` then a
  BUILD with state `(version, shape, dtype, is_fortran, raw bytes)` (version optional); Python 2
  protocols hold the raw bytes as latin-1 text;
- a dtype is `numpy.dtype(<"f4" | ml_dtypes class>, align, copy)` then a BUILD with state
  `(version, byteorder, subarray, names, fields, elsize, alignment, flags[, metadata])`;
- a scalar is `multiarray.scalar(dtype, raw bytes)`; `numeric._frombuffer(buf, dtype, shape,
  order)` is the protocol-5 array form.

Guards: `numpy.ndarray` is only an inert `Token` (NEWOBJ on it cannot allocate); dtypes holding
Python objects, fields or sub-arrays are refused (`UnsafePickleError`); an array's bytes must
be exactly `prod(shape) * itemsize`. Arrays and dtypes are first built as placeholders
(`_GuardedArray`, `_DtypeSpec`) whose BUILD state is checked, never handed to numpy as is;
`finalize` swaps them for plain `np.ndarray` and `np.dtype` after the load. bfloat16 and float8
come from ml_dtypes (named as tokens: ml_dtypes classes are mutable).
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Mapping
from types import MappingProxyType

import ml_dtypes
import numpy as np

from hybridckpt.containers.pickle.allow import Contextual, Stub, Token, UnpicklerView, short_repr
from hybridckpt.errors import FormatError, UnsafePickleError


def _check_np_dtype(dt: np.dtype, what: str) -> np.dtype:
    if dt.hasobject or dt.names is not None or dt.subdtype is not None or dt.kind == "O":
        raise UnsafePickleError(
            f"{what}: numpy dtype {dt!r} (objects, fields or sub-arrays) is not allowed in a pickle"
        )
    return dt


_NATIVE = "<" if sys.byteorder == "little" else ">"


class _DtypeSpec:
    """Placeholder for a pickled `numpy.dtype`: BUILD state is checked, never applied to numpy."""

    def __init__(self, up: UnpicklerView, obj, align=False, copy=True):
        if isinstance(obj, str):
            try:
                dt = np.dtype(obj)
            except TypeError as e:
                raise FormatError(f"{up.what}: bad numpy dtype {obj!r}") from e
        elif isinstance(obj, Token) and obj.name.startswith("ml_dtypes."):
            dt = np.dtype(getattr(ml_dtypes, obj.name[len("ml_dtypes.") :]))
        else:
            raise UnsafePickleError(f"{up.what}: numpy dtype from {short_repr(obj)} is not allowed")
        self.what = up.what
        self.dtype = _check_np_dtype(dt, up.what)
        up.needs_finalize = True

    def __setstate__(self, state):
        # numpy's dtype state: (version, byteorder, subarray, names, fields, elsize, align, flags[, meta])
        if not isinstance(state, tuple) or len(state) < 8:
            raise FormatError(f"{self.what}: bad numpy dtype state {short_repr(state)}")
        _, order, subarray, names, fields = state[:5]
        if subarray is not None or names is not None or fields is not None:
            raise UnsafePickleError(f"{self.what}: structured numpy dtypes are not allowed")
        if order not in ("<", ">", "|", "="):
            raise FormatError(f"{self.what}: bad numpy byte order {order!r}")
        if order in ("<", ">") and self.dtype.byteorder != "|" and order != _NATIVE:
            self.dtype = self.dtype.newbyteorder(order)


def _as_dtype(spec, what: str) -> np.dtype:
    if isinstance(spec, _DtypeSpec):
        return spec.dtype
    raise FormatError(f"{what}: expected a numpy dtype, found {short_repr(spec)}")


def _as_raw(data, what: str) -> bytes:
    if isinstance(data, str):  # protocol <= 2 from Python 2: latin-1 text holding the bytes
        return data.encode("latin1")
    if isinstance(data, (bytes, bytearray)):
        return data
    raise FormatError(f"{what}: expected raw array bytes, found {type(data).__name__}")


class _GuardedArray(np.ndarray):
    """What `numpy...._reconstruct` returns: its BUILD state is checked, then swapped for a plain array."""

    def __setstate__(self, state):
        what = self._what if hasattr(self, "_what") else "pickle"
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise FormatError(f"{what}: bad numpy array state {short_repr(state)}")
        if len(state) == 5:
            state = state[1:]
        shape, spec, fortran, raw = state
        dt = _as_dtype(spec, what)
        raw = _as_raw(raw, what)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise FormatError(f"{what}: negative numpy shape {shape}")
        count = 1
        for s in shape:
            count *= s
        if count * dt.itemsize != len(raw):
            raise FormatError(
                f"{what}: numpy array {shape} of {dt} needs {count * dt.itemsize} bytes, "
                f"found {len(raw)}"
            )
        np.ndarray.__setstate__(self, (shape, dt, bool(fortran), bytes(raw)))


NDARRAY = Token("numpy.ndarray")
"""What `numpy.ndarray` resolves to: only a tag for `_reconstruct`, NEWOBJ on it cannot allocate."""


def _np_reconstruct(up: UnpicklerView):
    def reconstruct(cls, shape, typecode):
        if cls is not NDARRAY:
            raise UnsafePickleError(
                f"{up.what}: numpy _reconstruct of {short_repr(cls)} is not allowed"
            )
        arr = np.ndarray.__new__(_GuardedArray, (0,), np.uint8)
        arr._what = up.what
        up.needs_finalize = True
        return arr

    return reconstruct


def _np_frombuffer(up: UnpicklerView):
    def frombuffer(buf, spec, shape, order):
        dt = _as_dtype(spec, up.what)
        raw = _as_raw(buf, up.what)
        shape = tuple(int(s) for s in shape)
        return np.frombuffer(raw, dtype=dt).reshape(shape, order="F" if order == "F" else "C")

    return frombuffer


def _np_scalar(up: UnpicklerView):
    def scalar(spec, data=None):
        dt = _as_dtype(spec, up.what)
        raw = _as_raw(data, up.what)
        if len(raw) != dt.itemsize:
            raise FormatError(f"{up.what}: numpy scalar of {dt} with {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dt)[0]

    return scalar


_ML_SCALAR_TYPES = frozenset(
    n
    for n in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(ml_dtypes, n)
)


def finalize(root):
    """Swap numpy placeholders (`_GuardedArray`, `_DtypeSpec`) for plain arrays and dtypes."""
    done: dict[int, object] = {}

    def conv(x):
        i = id(x)
        if i in done:
            return done[i]
        t = type(x)
        if t is _GuardedArray:
            out = x.view(np.ndarray)
        elif t is _DtypeSpec:
            out = x.dtype
        elif t is tuple:
            done[i] = x  # a cycle through a tuple keeps the original
            out = tuple(conv(v) for v in x)
            if all(a is b for a, b in zip(out, x, strict=True)):
                out = x
        elif isinstance(x, list):
            done[i] = x
            new = [conv(v) for v in x]
            if any(a is not b for a, b in zip(new, x, strict=True)):
                x[:] = new
            out = x
        elif isinstance(x, dict):
            done[i] = x
            items = [(conv(k), conv(v)) for k, v in x.items()]
            if any(
                k2 is not k or v2 is not v
                for (k2, v2), (k, v) in zip(items, x.items(), strict=True)
            ):
                x.clear()
                for k, v in items:  # dict.__setitem__: Counter.update would count, not set
                    dict.__setitem__(x, k, v)
            out = x
        elif t in (set, frozenset):
            out = t(conv(v) for v in x)
        elif isinstance(x, (Stub, argparse.Namespace, types.SimpleNamespace)):
            done[i] = x
            for k, v in list(vars(x).items()):
                vars(x)[k] = conv(v)
            out = x
        else:
            out = x
        done[i] = out
        return out

    return conv(root)


def _numpy_names() -> dict[tuple[str, str], object]:
    out: dict[tuple[str, str], object] = {}
    for core in ("numpy.core", "numpy._core"):
        out[(f"{core}.multiarray", "_reconstruct")] = Contextual(_np_reconstruct)
        out[(f"{core}.multiarray", "scalar")] = Contextual(_np_scalar)
        out[(f"{core}.numeric", "_frombuffer")] = Contextual(_np_frombuffer)
    out[("numpy", "ndarray")] = NDARRAY
    out[("numpy", "dtype")] = Contextual(lambda up: lambda *a: _DtypeSpec(up, *a))
    for t in _ML_SCALAR_TYPES:  # ml_dtypes classes are mutable: hand out tokens
        out[("ml_dtypes", t)] = Token(f"ml_dtypes.{t}")
    return out


NUMPY_ALLOWED: Mapping[tuple[str, str], object] = MappingProxyType(_numpy_names())
"""The numpy and ml_dtypes names a pickle may use, each guarded as above."""
