"""The one restricted unpickler: every pickle hybridckpt reads goes through `RestrictedUnpickler`.

Security model (the same as torch's `weights_only=True` loader, pytorch/pytorch:
torch/_weights_only_unpickler.py): a pickle can only name globals from an allow-list.

- `find_class` looks `(module, name)` up in a `Policy` (`allow`): allowed names return inert
  classes or guarded wrappers (`base_policy`, `numpy_guard`, `torch_policy`), stubbed prefixes
  return inert `Stub` classes, anything else raises `UnsafePickleError` naming `module.name`
  and the file; nothing ran. Python 2 names (`__builtin__.set`) are mapped as pickle maps them.
- Persistent ids are refused unless a subclass handles them (torch storages do).
- The two stdlib classes handed out as themselves (argparse.Namespace, collections.Counter) are
  compared with a snapshot after every load: a pickle that patched one is refused and the class
  restored.

Denial-of-service guards (`opcodes.check_pickle`, run before unpickling): every length-prefixed
argument must fit in the bytes left in the stream, memo indices must not run ahead of the
opcodes seen, and unknown opcodes are refused; after it, the result's expansion through shared
(memo) references is counted against a budget of objects and bytes (`budget`: billion laughs).
Every failure of a malformed pickle (truncation,
bad opcode, recursion, memory) is a `FormatError` naming the file. The C unpickler is used: it
does not recurse on nesting.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import io
import os
import pickle
import struct

from hybridckpt.containers.pickle.allow import Contextual, Policy, short_repr, stub_class
from hybridckpt.containers.pickle.base_policy import BASE_POLICY
from hybridckpt.containers.pickle.budget import check_expansion
from hybridckpt.containers.pickle.numpy_guard import finalize
from hybridckpt.containers.pickle.opcodes import scan_pickle
from hybridckpt.errors import FormatError, HybridCkptError, UnsafePickleError
from hybridckpt.io.byte_source import ByteSource

_MISSING = object()


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
            f"{self.what}: pickle uses persistent id {short_repr(pid)}, not allowed in this file"
        )

    def load(self):
        try:
            obj = super().load()
        finally:
            _check_shared_classes(self.what)
        return finalize(obj) if self.needs_finalize else obj


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


# -- loading -------------------------------------------------------------------------------

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
    walked: bool = False,
    **unpickler_kwargs,
) -> object:
    """Unpickle `data` (bytes-like) under `policy` (default `BASE_POLICY`).

    `what` names the source in every error (a file path, `path:entry`). Any failure of the
    pickle itself becomes `FormatError`; refused globals are `UnsafePickleError`.
    `walked`: the caller's own `scan_pickle` already walked these opcodes (paddle_save: the
    file's walk, whose FRAME opcodes it dropped and whose payloads it replaced by persistent ids,
    both at opcode boundaries the walk found), so the opcode pre-scan is not run again; the
    restricted unpickler and its policy run all the same.
    """
    policy = BASE_POLICY if policy is None else policy
    if isinstance(data, memoryview):
        data = data.tobytes()
    shared: tuple = ((-1, 1),)  # the caller walked: count the whole result
    try:
        if not walked:
            shared = scan_pickle(data, what=what).shared
    except FormatError as e:
        refuse_named_threat(e, policy, what)
        raise
    try:
        up = unpickler_cls(io.BytesIO(data), policy, what=what, **unpickler_kwargs)
        obj = up.load()
        if shared:  # without fetches of shared objects it holds no more than it built
            check_expansion(obj, len(data), what=what, shared=shared, memo=up.memo)
        return obj
    except HybridCkptError as e:
        if str(e).startswith(what):
            raise
        raise type(e)(f"{what}: {e}") from e  # raised by an object that does not know the file
    except _WRAPPED_ERRORS as e:
        raise FormatError(
            f"{what}: not a valid pickle: {type(e).__name__}: {short_repr(e, 300)}"
        ) from e


def refuse_named_threat(e: FormatError, policy: Policy, what: str) -> None:
    """When a pickle refused as malformed also names a global that no checkpoint may use
    (`os.system`, `builtins.exec`, ...; found by the opcode walk before it stopped), raise
    UnsafePickleError saying that first: it is what a user needs to know. Otherwise return."""
    for module, name in getattr(e, "globals", ()):
        if (module, name) in policy.allowed or policy.is_stubbed(f"{module}.{name}"):
            continue
        raise UnsafePickleError(
            f"{what}: pickle refers to global '{module}.{name}', which is not on the allow-list "
            f"(a pickle that would run code when loaded); refused without running it; it is also "
            f"malformed: {str(e).removeprefix(what + ': ')}"
        ) from e


def safe_load_file(path: str | os.PathLike, policy: Policy | None = None) -> object:
    """Read a whole pickle file (small ones: `.metadata`, args files, `.pdparams`) and unpickle it."""
    path = os.fspath(path)
    src = ByteSource(path)
    data = src.read(0, src.size())
    return safe_loads(data, policy, what=path)
