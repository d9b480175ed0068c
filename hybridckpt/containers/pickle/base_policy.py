"""The Python names every pickle may use: `BASE_ALLOWED` and `BASE_POLICY`.

Plain containers and numbers are handed out as their real classes (inert to construct).
Builtins that could allocate or run code are guarded wrappers bound to the unpickler:
- `bytes` / `bytearray` refuse a size argument (`bytes(10**12)`), and build only from bytes,
  lists or latin-1 text;
- `_codecs.encode` only turns latin-1 text into bytes (protocol 2 writes bytes that way);
- `copyreg._reconstructor` (protocol 0/1 objects) and `copyreg.__newobj__` only build stubs or
  the constructible classes below, and only on a base they derive from;
- `collections.defaultdict` only takes a plain container or number as its factory;
- `pathlib` paths become `PurePosixPath` (no file system access);
- numpy and ml_dtypes names come from `numpy_guard`.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import io
import pathlib
import types
from collections.abc import Mapping
from types import MappingProxyType

from hybridckpt.containers.pickle.allow import (
    Contextual,
    Frozen,
    Policy,
    Stub,
    UnpicklerView,
    short_repr,
)
from hybridckpt.containers.pickle.numpy_guard import NUMPY_ALLOWED
from hybridckpt.errors import FormatError, UnsafePickleError


def _safe_bytes(up: UnpicklerView):
    def make(*args):
        if len(args) == 0:
            return b""
        if isinstance(args[0], int):
            raise UnsafePickleError(f"{up.what}: bytes(<size>) is not allowed in a pickle")
        if len(args) == 2 and args[1] in ("latin1", "latin-1") and isinstance(args[0], str):
            return args[0].encode("latin1")
        if len(args) == 1 and isinstance(args[0], (bytes, bytearray, list, tuple)):
            return bytes(args[0])
        raise UnsafePickleError(f"{up.what}: bytes{short_repr(args)} is not allowed")

    return make


def _safe_bytearray(up: UnpicklerView):
    def make(*args):
        return bytearray(_safe_bytes(up)(*args))

    return make


def _codecs_encode(up: UnpicklerView):
    # protocol-2 pickles store bytes as `_codecs.encode(<latin-1 text>, 'latin1')`
    def encode(obj, encoding="utf-8", errors="strict"):
        if isinstance(obj, str) and encoding in ("latin1", "latin-1"):
            return obj.encode("latin1")
        raise UnsafePickleError(f"{up.what}: _codecs.encode(..., {encoding!r}) is not allowed")

    return encode


_CONSTRUCTIBLE = (
    object,
    set,
    frozenset,
    list,
    dict,
    tuple,
    int,
    float,
    complex,
    bool,
    collections.OrderedDict,
    collections.Counter,
    argparse.Namespace,
    types.SimpleNamespace,
)


def _checked_class(up: UnpicklerView, cls, what: str):
    if isinstance(cls, type) and (issubclass(cls, Stub) or cls in _CONSTRUCTIBLE):
        return cls
    raise UnsafePickleError(f"{up.what}: {what} of {short_repr(cls)} is not allowed")


def _copyreg_reconstructor(up: UnpicklerView):
    # copyreg._reconstructor(cls, base, state): protocol 0/1 objects
    def reconstruct(cls, base, state):
        cls = _checked_class(up, cls, "copyreg._reconstructor")
        if issubclass(cls, Stub):
            return cls(state) if base is not object else cls()
        if base not in _CONSTRUCTIBLE or not issubclass(cls, base):
            raise UnsafePickleError(f"{up.what}: copyreg._reconstructor base {short_repr(base)}")
        return object.__new__(cls) if base is object else base.__new__(cls, state)

    return reconstruct


def _copyreg_newobj(up: UnpicklerView):
    def newobj(cls, *args):
        cls = _checked_class(up, cls, "copyreg.__newobj__")
        return cls.__new__(cls, *args)

    return newobj


def _defaultdict(up: UnpicklerView):
    factories = (None, list, dict, set, int, float, tuple, collections.OrderedDict)

    def make(factory=None, *args):
        if factory not in factories:
            raise UnsafePickleError(f"{up.what}: defaultdict factory {short_repr(factory)}")
        return collections.defaultdict(factory, *args)

    return make


def _pure_path(*parts):
    if not all(isinstance(p, str) for p in parts):
        raise FormatError(f"path parts {short_repr(parts)} are not strings")
    return pathlib.PurePosixPath(*parts)


BASE_ALLOWED: Mapping[tuple[str, str], object] = MappingProxyType(
    {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "Counter"): collections.Counter,
        ("collections", "defaultdict"): Contextual(_defaultdict),
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "list"): list,
        ("builtins", "dict"): dict,
        ("builtins", "tuple"): tuple,
        ("builtins", "int"): int,
        ("builtins", "float"): float,
        ("builtins", "complex"): complex,
        ("builtins", "bool"): bool,
        ("builtins", "slice"): slice,
        ("builtins", "object"): object,
        ("builtins", "bytes"): Contextual(_safe_bytes),
        ("builtins", "bytearray"): Contextual(_safe_bytearray),
        ("_codecs", "encode"): Contextual(_codecs_encode),
        ("copyreg", "_reconstructor"): Contextual(_copyreg_reconstructor),
        ("copyreg", "__newobj__"): Contextual(_copyreg_newobj),
        ("argparse", "Namespace"): argparse.Namespace,
        ("types", "SimpleNamespace"): types.SimpleNamespace,
        ("pathlib", "PosixPath"): Frozen(_pure_path),
        ("pathlib", "PurePosixPath"): Frozen(_pure_path),
        ("datetime", "datetime"): datetime.datetime,
        ("datetime", "date"): datetime.date,
        ("datetime", "timedelta"): datetime.timedelta,
        ("io", "BytesIO"): io.BytesIO,  # Transformer Engine extra state (megatron safe_globals)
        **NUMPY_ALLOWED,
    }
)

BASE_POLICY = Policy(BASE_ALLOWED, ())
"""Plain Python containers, argparse/SimpleNamespace, guarded numpy: no stubs."""
