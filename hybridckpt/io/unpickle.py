"""The one restricted unpickler: every pickle hybridckpt reads goes through `RestrictedUnpickler`.

Security model (the same as torch's `weights_only=True` loader, pytorch/pytorch:
torch/_weights_only_unpickler.py): a pickle can only name globals from an allow-list.

- `Policy.allowed` maps `(module, name)` to the object `find_class` returns: real classes that
  are inert to construct (OrderedDict, set, argparse.Namespace, ...) or guarded wrappers
  (`bytes`/`bytearray` refuse sizes, numpy arrays and dtypes are rebuilt from checked state and
  never hold Python objects, `copyreg._reconstructor` only builds allowed or stub classes).
- `Policy.stub_prefixes` names framework code we must not import (megatron, deepspeed, paddle,
  ...): those globals become inert `Stub` classes that record their constructor arguments and
  state and execute nothing.
- Anything else raises `UnsafePickleError` naming `module.name` and the file; nothing ran.
- Persistent ids are refused unless a subclass handles them (torch storages do).

Denial-of-service guards (`check_pickle`, run before unpickling): every length-prefixed argument
(BINBYTES, BINUNICODE, BINBYTES8, LONG4, FRAME, ...) must fit in the bytes left in the stream
(CPython allocates the claimed size before reading it), memo indices must not run ahead of the
opcodes seen (CPython grows its memo table to the index), and unknown opcodes are refused.
Every failure of a malformed pickle (truncation, bad opcode, recursion, memory) is a
`FormatError` naming the file.

Torch names every pickle reader meets (dtypes `torch.float32`, `torch.Size`, `torch.device`,
layouts) are in `TORCH_POLICY`; a dtype becomes a `TorchDtype` carrying its numpy dtype
(bfloat16 and float8 via ml_dtypes).
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import datetime
import io
import os
import pathlib
import pickle
import pickletools
import reprlib
import struct
import sys
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import ml_dtypes
import numpy as np

from hybridckpt.errors import FormatError, HybridCkptError, UnsafePickleError
from hybridckpt.io.byte_source import ByteSource

# -- policy ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What a pickle may name.

    `allowed`: `(module, name) -> object` returned by `find_class` (a `Contextual` is bound to
    the unpickler first). `stub_prefixes`: dotted prefixes of `module.name` that become `Stub`
    classes (`"megatron."` matches every name under the package, `"signal.Signals"` one name).

    A pickle can BUILD (set attributes) on anything `find_class` returns, so allowed values must
    be immutable (C types, `Token`, `Frozen`, `TorchDtype`: no `__dict__`, a refusing
    `__setstate__`) or fresh per lookup
    (`Contextual`); the two stdlib Python classes handed out as is (argparse.Namespace,
    collections.Counter) are checked after every load.
    """

    allowed: Mapping[tuple[str, str], object] = field(default_factory=dict)
    stub_prefixes: tuple[str, ...] = ()

    def merged(self, other: Policy | None) -> Policy:
        """This policy plus `other`'s names (other wins on conflicts)."""
        if other is None:
            return self
        return Policy(
            MappingProxyType({**self.allowed, **other.allowed}),
            tuple(dict.fromkeys(self.stub_prefixes + other.stub_prefixes)),
        )

    def is_stubbed(self, qualname: str) -> bool:
        for p in self.stub_prefixes:
            p = p.rstrip(".")
            if qualname == p or qualname.startswith(p + "."):
                return True
        return False


class Contextual:
    """An allow-list entry that needs the unpickler (its policy, its file name) to act; `bind`
    runs at each lookup, so what it returns is fresh per pickle."""

    def __init__(self, bind: Callable[[RestrictedUnpickler], object]):
        self.bind = bind


class _Immutable:
    __slots__ = ()

    def __setattr__(self, name, value):
        raise UnsafePickleError(f"pickle tried to set {name!r} on {self!r}")

    __delattr__ = __setattr__

    def __setstate__(self, state):
        raise UnsafePickleError(f"pickle tried to set the state of {self!r}")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class Token(_Immutable):
    """An inert, immutable name a pickle may refer to (e.g. `numpy.ndarray` for `_reconstruct`)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return f"<{self.name}>"


class Frozen(_Immutable):
    """A module-level function handed to pickles, wrapped so a pickle cannot patch it."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args):
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"<{self.fn.__qualname__}>"


# -- stubs -------------------------------------------------------------------------------


class _StubMeta(type):
    """Stub classes are shared by every load: a pickle must not set attributes on them."""

    def __setattr__(cls, name, value):
        raise UnsafePickleError(f"pickle tried to set {name!r} on stub class {cls.__qualname__}")

    __delattr__ = __setattr__


class Stub(metaclass=_StubMeta):
    """Inert stand-in for a framework class or function that is never imported.

    Records what the pickle asked for and runs nothing:
    `stub_args` / `stub_kwargs` (constructor or call arguments), `stub_state` (the BUILD state;
    dict states are also copied into attributes so `obj.field` works), `stub_items` (dict-like
    SETITEM calls), `stub_list` (APPEND calls). The class has `stub_module`, `stub_name` and
    `stub_qualname()`.
    """

    stub_module: str = ""
    stub_name: str = ""
    stub_args: tuple = ()
    stub_kwargs: Mapping = MappingProxyType({})
    stub_state: object = None

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.__dict__["stub_args"] = args
        if kwargs:
            self.__dict__["stub_kwargs"] = dict(kwargs)
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        d = self.__dict__
        parts = (state,)
        if isinstance(state, tuple) and len(state) == 2:
            parts = state  # (dict state, slot state)
        for part in parts:
            if isinstance(part, dict):
                for k, v in part.items():
                    if isinstance(k, str) and not k.startswith(("stub_", "__")):
                        d[k] = v
        d["stub_state"] = state

    def __setitem__(self, key, value):
        self.__dict__.setdefault("stub_items", {})[key] = value

    def append(self, value):
        self.__dict__.setdefault("stub_list", []).append(value)

    def extend(self, values):
        self.__dict__.setdefault("stub_list", []).extend(values)

    @classmethod
    def stub_qualname(cls) -> str:
        return f"{cls.stub_module}.{cls.stub_name}"

    def __repr__(self) -> str:
        r = reprlib.Repr()
        r.maxlevel, r.maxother = 2, 40
        return f"<stub {self.stub_qualname()}{r.repr(self.stub_args)}>"


_stub_lock = threading.Lock()
_stub_classes: dict[tuple[str, str], type[Stub]] = {}


def stub_class(module: str, name: str) -> type[Stub]:
    """The (cached) `Stub` subclass standing for global `module.name`."""
    with _stub_lock:
        cls = _stub_classes.get((module, name))
        if cls is None:
            ns = {
                "stub_module": module,
                "stub_name": name,
                "__module__": "stub:" + module,
                "__qualname__": name,
            }
            cls = _StubMeta(name.rsplit(".", 1)[-1], (Stub,), ns)
            _stub_classes[(module, name)] = cls
        return cls


def is_stub(obj: object, qualname: str | None = None) -> bool:
    """Whether `obj` is a Stub instance or class (standing for `qualname` when given)."""
    cls = obj if isinstance(obj, type) else type(obj)
    if not (isinstance(cls, type) and issubclass(cls, Stub)):
        return False
    return qualname is None or cls.stub_qualname() == qualname


# -- the unpickler -----------------------------------------------------------------------


def _short(obj: object, n: int = 120) -> str:
    r = reprlib.Repr()
    r.maxstring = r.maxother = n
    return r.repr(obj)


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` whose `find_class` obeys a `Policy`; `what` names the file in errors.

    Subclasses may handle persistent ids by overriding `persistent_load`.
    """

    def __init__(self, file, policy: Policy, *, what: str, encoding: str = "latin1"):
        super().__init__(file, encoding=encoding)
        self.policy = policy
        self.what = what
        self.needs_finalize = False  # set by numpy guards: placeholders to swap after load

    def find_class(self, module: str, name: str):
        if not isinstance(module, str) or not isinstance(name, str):
            raise UnsafePickleError(f"{self.what}: global with a non-string name")
        # Python 2 names (protocol <= 2 pickles say `__builtin__.set`), as pickle itself maps them
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        obj = self.policy.allowed.get((module, name), _MISSING)
        if obj is not _MISSING:
            return obj.bind(self) if isinstance(obj, Contextual) else obj
        if self.policy.is_stubbed(f"{module}.{name}"):
            return stub_class(module, name)
        raise UnsafePickleError(
            f"{self.what}: pickle refers to global '{module}.{name}', which is not on the "
            "allow-list; refused without running it"
        )

    def persistent_load(self, pid):
        raise UnsafePickleError(
            f"{self.what}: pickle uses persistent id {_short(pid)}, not allowed in this file"
        )

    def load(self):
        try:
            obj = super().load()
        finally:
            _check_shared_classes(self.what)
        return _finalize(obj) if self.needs_finalize else obj


# Python classes handed to pickles as themselves (NEWOBJ needs the real class): a BUILD with slot
# state could set attributes on them, so they are compared with a snapshot after every load.
# `copyreg._slotnames` caches `__slotnames__ = []` on a class the first time the process pickles
# an instance (e.g. `torch.save(args)` before an import): that entry is not a pickle's doing.
_SHARED_CLASSES = (argparse.Namespace, collections.Counter)


def _own_vars(cls) -> dict:
    d = dict(vars(cls))
    if type(d.get("__slotnames__")) is list and not d["__slotnames__"]:
        del d["__slotnames__"]
    return d


_PRISTINE = {cls: _own_vars(cls) for cls in _SHARED_CLASSES}


def _check_shared_classes(what: str) -> None:
    for cls, pristine in _PRISTINE.items():
        now = _own_vars(cls)
        if now.keys() == pristine.keys() and all(now[k] is v for k, v in pristine.items()):
            continue
        for k in set(now) - set(pristine):
            delattr(cls, k)
        for k, v in pristine.items():
            if now.get(k, _MISSING) is not v:
                setattr(cls, k, v)
        raise UnsafePickleError(
            f"{what}: pickle tried to modify class {cls.__module__}.{cls.__qualname__}"
        )


_MISSING = object()

# -- DoS pre-scan ------------------------------------------------------------------------

_FIXED, _COUNTED, _LINES, _NOARG = 0, 1, 2, 3
_COUNT_FORMS = {  # pickletools argument length codes -> (size bytes, signed)
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _opcode_table() -> list:
    table: list = [None] * 256
    for op in pickletools.opcodes:
        code = ord(op.code)
        arg = op.arg
        if arg is None:
            table[code] = (_NOARG, 0, False)
        elif arg.n >= 0:
            table[code] = (_FIXED, arg.n, False)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[code] = (_LINES, 2 if arg.name.endswith("_pair") else 1, False)
        else:
            size, signed = _COUNT_FORMS[arg.n]
            table[code] = (_COUNTED, size, signed)
    return table


_TABLE = _opcode_table()
# public for other opcode walkers (paddle_pickle's lazy scan): per opcode byte,
# (argument kind, size in bytes or lines, signed)
OPCODE_ARGS = _TABLE
ARG_FIXED, ARG_COUNTED, ARG_LINES, ARG_NONE = _FIXED, _COUNTED, _LINES, _NOARG
_STOP, _FRAME = ord("."), 0x95
_LONG_BINPUT, _PUT = ord("r"), ord("p")


class _Truncated(FormatError):
    """The pickle runs past the bytes given (a caller may read more and retry)."""


def check_pickle(data, start: int = 0, *, what: str, stream_end: int | None = None) -> int:
    """Scan one pickle in `data[start:]` without running it; return the offset after its STOP.

    Length claims are judged against `stream_end` (default `len(data)`), the end of the whole
    stream. Raises `FormatError` for claims past the end, memo indices ahead of the opcodes
    seen, unknown opcodes, and a pickle that ends before STOP.
    """
    n = len(data)
    end = n if stream_end is None else stream_end
    table = _TABLE
    pos = start
    ops = 0
    while True:
        if pos >= n:
            raise _Truncated(f"{what}: pickle truncated at byte {pos} (no STOP opcode)")
        code = data[pos]
        spec = table[code]
        if spec is None:
            raise FormatError(f"{what}: not a pickle: unknown opcode {code:#04x} at byte {pos}")
        pos += 1
        kind, size, signed = spec
        if kind == _FIXED:
            if pos + size > n:
                raise _Truncated(f"{what}: pickle truncated at byte {pos}")
            if code == _LONG_BINPUT and int.from_bytes(data[pos : pos + 4], "little") > ops:
                raise FormatError(f"{what}: memo index at byte {pos} runs ahead of the pickle")
            if code == _FRAME and int.from_bytes(data[pos : pos + 8], "little") > end - pos - 8:
                raise FormatError(f"{what}: frame at byte {pos} claims more bytes than remain")
            pos += size
        elif kind == _COUNTED:
            if pos + size > n:
                raise _Truncated(f"{what}: pickle truncated at byte {pos}")
            length = int.from_bytes(data[pos : pos + size], "little", signed=signed)
            pos += size
            if length < 0 or length > end - pos:
                raise FormatError(
                    f"{what}: opcode {code:#04x} at byte {pos - size - 1} claims {length} bytes "
                    f"but {end - pos} remain"
                )
            if pos + length > n:
                raise _Truncated(f"{what}: pickle truncated at byte {pos}")
            pos += length
        elif kind == _LINES:
            first = pos
            for _ in range(size):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    raise _Truncated(f"{what}: pickle truncated at byte {pos}")
                pos = nl + 1
            if code == _PUT:
                try:
                    idx = int(bytes(data[first : pos - 1]))
                except ValueError:
                    raise FormatError(f"{what}: bad PUT argument at byte {first}") from None
                if idx > ops:
                    raise FormatError(
                        f"{what}: memo index at byte {first} runs ahead of the pickle"
                    )
        elif code == _STOP:
            return pos
        ops += 1


_WRAPPED_ERRORS = (
    pickle.PickleError,
    ValueError,
    EOFError,
    RecursionError,
    MemoryError,
    TypeError,
    AttributeError,
    LookupError,
    ArithmeticError,
    struct.error,
)


def safe_loads(
    data,
    policy: Policy | None = None,
    *,
    what: str,
    unpickler_cls: type[RestrictedUnpickler] = RestrictedUnpickler,
    **unpickler_kwargs,
) -> object:
    """Unpickle `data` (bytes-like) under `policy` (default `BASE_POLICY`).

    `what` names the source in every error (a file path, `path:entry`). Any failure of the
    pickle itself becomes `FormatError`; refused globals are `UnsafePickleError`.
    """
    policy = BASE_POLICY if policy is None else policy
    if isinstance(data, memoryview):
        data = data.tobytes()
    check_pickle(data, what=what)
    try:
        up = unpickler_cls(io.BytesIO(data), policy, what=what, **unpickler_kwargs)
        return up.load()
    except HybridCkptError as e:
        if str(e).startswith(what):
            raise
        raise type(e)(f"{what}: {e}") from e  # raised by an object that does not know the file
    except _WRAPPED_ERRORS as e:
        raise FormatError(
            f"{what}: not a valid pickle: {type(e).__name__}: {_short(e, 300)}"
        ) from e


def safe_load_file(path: str | os.PathLike, policy: Policy | None = None) -> object:
    """Read a whole pickle file (small ones: `.metadata`, args files, `.pdparams`) and unpickle it."""
    path = os.fspath(path)
    src = ByteSource(path)
    data = src.read(0, src.size())
    return safe_loads(data, policy, what=path)


# -- numpy, guarded ------------------------------------------------------------------------


def _check_np_dtype(dt: np.dtype, what: str) -> np.dtype:
    if dt.hasobject or dt.names is not None or dt.subdtype is not None or dt.kind == "O":
        raise UnsafePickleError(
            f"{what}: numpy dtype {dt!r} (objects, fields or sub-arrays) is not allowed in a pickle"
        )
    return dt


_NATIVE = "<" if sys.byteorder == "little" else ">"


class _DtypeSpec:
    """Placeholder for a pickled `numpy.dtype`: BUILD state is checked, never applied to numpy."""

    def __init__(self, up: RestrictedUnpickler, obj, align=False, copy=True):
        if isinstance(obj, str):
            try:
                dt = np.dtype(obj)
            except TypeError as e:
                raise FormatError(f"{up.what}: bad numpy dtype {obj!r}") from e
        elif isinstance(obj, Token) and obj.name.startswith("ml_dtypes."):
            dt = np.dtype(getattr(ml_dtypes, obj.name[len("ml_dtypes.") :]))
        else:
            raise UnsafePickleError(f"{up.what}: numpy dtype from {_short(obj)} is not allowed")
        self.what = up.what
        self.dtype = _check_np_dtype(dt, up.what)
        up.needs_finalize = True

    def __setstate__(self, state):
        # numpy's dtype state: (version, byteorder, subarray, names, fields, elsize, align, flags[, meta])
        if not isinstance(state, tuple) or len(state) < 8:
            raise FormatError(f"{self.what}: bad numpy dtype state {_short(state)}")
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
    raise FormatError(f"{what}: expected a numpy dtype, found {_short(spec)}")


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
            raise FormatError(f"{what}: bad numpy array state {_short(state)}")
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


def _np_reconstruct(up: RestrictedUnpickler):
    def reconstruct(cls, shape, typecode):
        if cls is not _NDARRAY:
            raise UnsafePickleError(
                f"{up.what}: numpy _reconstruct of {_short(cls)} is not allowed"
            )
        arr = np.ndarray.__new__(_GuardedArray, (0,), np.uint8)
        arr._what = up.what
        up.needs_finalize = True
        return arr

    return reconstruct


def _np_frombuffer(up: RestrictedUnpickler):
    def frombuffer(buf, spec, shape, order):
        dt = _as_dtype(spec, up.what)
        raw = _as_raw(buf, up.what)
        shape = tuple(int(s) for s in shape)
        return np.frombuffer(raw, dtype=dt).reshape(shape, order="F" if order == "F" else "C")

    return frombuffer


def _np_scalar(up: RestrictedUnpickler):
    def scalar(spec, data=None):
        dt = _as_dtype(spec, up.what)
        raw = _as_raw(data, up.what)
        if len(raw) != dt.itemsize:
            raise FormatError(f"{up.what}: numpy scalar of {dt} with {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dt)[0]

    return scalar


_NDARRAY = Token("numpy.ndarray")  # only a tag for `_reconstruct`: NEWOBJ on it cannot allocate


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


def _finalize(root):
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


# -- other guarded builtins ------------------------------------------------------------------


def _safe_bytes(up: RestrictedUnpickler):
    def make(*args):
        if len(args) == 0:
            return b""
        if isinstance(args[0], int):
            raise UnsafePickleError(f"{up.what}: bytes(<size>) is not allowed in a pickle")
        if len(args) == 2 and args[1] in ("latin1", "latin-1") and isinstance(args[0], str):
            return args[0].encode("latin1")
        if len(args) == 1 and isinstance(args[0], (bytes, bytearray, list, tuple)):
            return bytes(args[0])
        raise UnsafePickleError(f"{up.what}: bytes{_short(args)} is not allowed")

    return make


def _safe_bytearray(up: RestrictedUnpickler):
    def make(*args):
        return bytearray(_safe_bytes(up)(*args))

    return make


def _codecs_encode(up: RestrictedUnpickler):
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


def _checked_class(up: RestrictedUnpickler, cls, what: str):
    if isinstance(cls, type) and (issubclass(cls, Stub) or cls in _CONSTRUCTIBLE):
        return cls
    raise UnsafePickleError(f"{up.what}: {what} of {_short(cls)} is not allowed")


def _copyreg_reconstructor(up: RestrictedUnpickler):
    # copyreg._reconstructor(cls, base, state): protocol 0/1 objects
    def reconstruct(cls, base, state):
        cls = _checked_class(up, cls, "copyreg._reconstructor")
        if issubclass(cls, Stub):
            return cls(state) if base is not object else cls()
        if base not in _CONSTRUCTIBLE or not issubclass(cls, base):
            raise UnsafePickleError(f"{up.what}: copyreg._reconstructor base {_short(base)}")
        return object.__new__(cls) if base is object else base.__new__(cls, state)

    return reconstruct


def _copyreg_newobj(up: RestrictedUnpickler):
    def newobj(cls, *args):
        cls = _checked_class(up, cls, "copyreg.__newobj__")
        return cls.__new__(cls, *args)

    return newobj


def _defaultdict(up: RestrictedUnpickler):
    factories = (None, list, dict, set, int, float, tuple, collections.OrderedDict)

    def make(factory=None, *args):
        if factory not in factories:
            raise UnsafePickleError(f"{up.what}: defaultdict factory {_short(factory)}")
        return collections.defaultdict(factory, *args)

    return make


def _pure_path(*parts):
    if not all(isinstance(p, str) for p in parts):
        raise FormatError(f"path parts {_short(parts)} are not strings")
    return pathlib.PurePosixPath(*parts)


def _numpy_names() -> dict[tuple[str, str], object]:
    out: dict[tuple[str, str], object] = {}
    for core in ("numpy.core", "numpy._core"):
        out[(f"{core}.multiarray", "_reconstruct")] = Contextual(_np_reconstruct)
        out[(f"{core}.multiarray", "scalar")] = Contextual(_np_scalar)
        out[(f"{core}.numeric", "_frombuffer")] = Contextual(_np_frombuffer)
    out[("numpy", "ndarray")] = _NDARRAY
    out[("numpy", "dtype")] = Contextual(lambda up: lambda *a: _DtypeSpec(up, *a))
    for t in _ML_SCALAR_TYPES:  # ml_dtypes classes are mutable: hand out tokens
        out[("ml_dtypes", t)] = Token(f"ml_dtypes.{t}")
    return out


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
        **_numpy_names(),
    }
)

# -- torch names met outside torch.save tensors ---------------------------------------------


@dataclass(frozen=True, slots=True)
class TorchDtype:
    """A torch dtype named in a pickle: `name` as torch spells it (`"bfloat16"`), `itemsize` in
    bytes, `numpy` the matching numpy dtype (None when numpy has none: quantized, complex32,
    packed 4-bit)."""

    name: str
    itemsize: int
    numpy: np.dtype | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    # shared constants: a pickle's BUILD must not reach dataclass's slot `__setstate__`
    def __setstate__(self, state):
        raise UnsafePickleError(f"pickle tried to set the state of {self!r}")

    def __reduce__(self):
        return TorchDtype, (self.name, self.itemsize, self.numpy)


def _torch_dtypes() -> dict[str, TorchDtype]:
    ml = {n: np.dtype(getattr(ml_dtypes, n)) for n in dir(ml_dtypes) if n.startswith("float8")}
    ml["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
    table = {
        # name: (itemsize, numpy dtype or None)
        "float32": (4, np.float32),
        "float64": (8, np.float64),
        "float16": (2, np.float16),
        "bfloat16": (2, ml["bfloat16"]),
        "complex32": (4, None),
        "complex64": (8, np.complex64),
        "complex128": (16, np.complex128),
        "uint8": (1, np.uint8),
        "uint16": (2, np.uint16),
        "uint32": (4, np.uint32),
        "uint64": (8, np.uint64),
        "int8": (1, np.int8),
        "int16": (2, np.int16),
        "int32": (4, np.int32),
        "int64": (8, np.int64),
        "bool": (1, np.bool_),
        "qint8": (1, None),
        "quint8": (1, None),
        "qint32": (4, None),
        "quint4x2": (1, None),
        "quint2x4": (1, None),
        "float4_e2m1fn_x2": (1, None),
        "bits8": (1, None),
        "bits16": (2, None),
        "bits1x8": (1, None),
        "bits2x4": (1, None),
        "bits4x2": (1, None),
    }
    for n in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ):
        table[n] = (1, ml.get(n))
    for b in range(1, 8):
        table[f"int{b}"] = (1, None)
        table[f"uint{b}"] = (1, None)
    out = {
        n: TorchDtype(n, size, None if d is None else np.dtype(d)) for n, (size, d) in table.items()
    }
    aliases = {
        "float": "float32",
        "double": "float64",
        "half": "float16",
        "cfloat": "complex64",
        "cdouble": "complex128",
        "chalf": "complex32",
        "long": "int64",
        "int": "int32",
        "short": "int16",
    }
    for a, n in aliases.items():
        out[a] = out[n]
    return out


TORCH_DTYPES: Mapping[str, TorchDtype] = MappingProxyType(_torch_dtypes())


def _torch_size(dims=()):
    return tuple(int(d) for d in dims)


def _torch_device(kind, index=None):
    kind = str(kind)
    return kind if index is None else f"{kind}:{int(index)}"


_TORCH_CONSTANTS = (
    "strided",
    "sparse_coo",
    "sparse_csr",
    "sparse_csc",
    "sparse_bsr",
    "sparse_bsc",
    "_mkldnn",
    "jagged",
    "contiguous_format",
    "preserve_format",
    "channels_last",
    "channels_last_3d",
    "per_tensor_affine",
    "per_channel_affine",
    "per_tensor_symmetric",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
)


def _torch_get_layout(name):
    # pytorch/pytorch: torch/serialization.py `_get_layout("torch.strided")`
    if not isinstance(name, str) or name[len("torch.") :] not in _TORCH_CONSTANTS:
        raise FormatError(f"unknown torch layout {_short(name)}")
    return name


TORCH_ALLOWED: Mapping[tuple[str, str], object] = MappingProxyType(
    {
        **{("torch", n): d for n, d in TORCH_DTYPES.items()},
        ("torch", "Size"): Frozen(_torch_size),
        ("torch", "device"): Frozen(_torch_device),
        ("torch.serialization", "_get_layout"): Frozen(_torch_get_layout),
        # layouts and memory formats pickle as their name; kept as the string "torch.<name>"
        **{("torch", n): f"torch.{n}" for n in _TORCH_CONSTANTS},
    }
)

FRAMEWORK_STUBS: tuple[str, ...] = (
    "megatron.",
    "deepspeed.",
    "apex.",
    "transformer_engine.",
    "fairscale.",
    "colossalai.",
    "nemo.",
    "paddle.",
    "paddlenlp.",
    "torch.distributed.checkpoint.",
    "torch._C.Generator",
    "torch.Generator",
    "signal.Signals",
)

BASE_POLICY = Policy(BASE_ALLOWED, ())
"""Plain Python containers, argparse/SimpleNamespace, guarded numpy: no stubs."""

TORCH_POLICY = Policy(MappingProxyType({**BASE_ALLOWED, **TORCH_ALLOWED}), FRAMEWORK_STUBS)
"""BASE_POLICY plus torch dtypes/Size/device and framework stubs (tensors: see torch_save)."""
