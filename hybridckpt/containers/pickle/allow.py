"""The allow-list vocabulary: what a pickle may name, and the inert stubs for what it may not run.

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

A pickle can BUILD (set attributes) on anything `find_class` returns, so the values handed out
are immutable (`Token`, `Frozen`: no `__dict__`, a refusing `__setstate__`), fresh per lookup
(`Contextual`) or stub classes whose metaclass refuses attribute writes.
"""

from __future__ import annotations

import reprlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from hybridckpt.errors import UnsafePickleError, short_repr  # noqa: F401 - short_repr re-exported

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


class UnpicklerView(Protocol):
    """What an allow-list entry sees of the unpickler that binds it (`machine.RestrictedUnpickler`)."""

    what: str  # the file (or `file:entry`) named in every error
    needs_finalize: bool  # set by numpy guards: placeholders to swap after the load


class Contextual:
    """An allow-list entry that needs the unpickler (its policy, its file name) to act; `bind`
    runs at each lookup, so what it returns is fresh per pickle."""

    def __init__(self, bind: Callable[[UnpicklerView], object]):
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
