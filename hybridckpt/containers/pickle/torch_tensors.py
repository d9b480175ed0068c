"""Torch tensors and storages inside a torch.save pickle, rebuilt as `LazyTensor` views.

Format (pytorch/pytorch: torch/_utils.py `_rebuild_*`, torch/_tensor.py `__reduce_ex__`,
torch/serialization.py `persistent_id`):
- Tensors: `torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
  requires_grad, backward_hooks[, metadata])`; `_rebuild_tensor_v3(..., dtype[, metadata])` for
  dtypes without a legacy storage class (uint16, float8, ...); parameters wrap a tensor in
  `_rebuild_parameter[_with_state]`; tensors with Python attributes in
  `torch._tensor._rebuild_from_type_v2(func, type, args, state)`. Offsets, sizes and strides
  count elements, not bytes.
- A storage is the persistent id `('storage', torch.<T>Storage | torch.UntypedStorage, key,
  location, numel)`: `numel` elements of T (bytes for UntypedStorage). Several tensors can
  share one key (views, tied weights): they view the same bytes. Legacy files add a sixth item,
  the view `(view key, offset, size)` in elements of its root storage.
- Device tensors saved from numpy or a CPU copy (`_rebuild_device_tensor_from_*`) are read as
  that array; quantized, sparse, nested, wrapper-subclass and meta tensors, and tensors with
  conjugate/negative bits, are refused with a `FormatError`.

Where a storage's bytes lie is the container's business (`torch_save`): it passes `resolve(key,
dtype, nbytes, view) -> Storage` and this module checks the rest. Nothing here reads tensor
bytes: a tensor is a strided view of a storage, read when a box of it is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from hybridckpt.containers.pickle.allow import Contextual, Frozen, Policy, Token
from hybridckpt.containers.pickle.machine import RestrictedUnpickler, safe_loads
from hybridckpt.containers.pickle.torch_policy import TORCH_DTYPES, TORCH_POLICY, TorchDtype
from hybridckpt.errors import FormatError, UnsafePickleError
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.lazy import ArrayTensor, LazyTensor, stored_strided

# -- storages --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StorageType:
    """A storage class named in a pickle (`torch.FloatStorage`, `torch.UntypedStorage`)."""

    name: str
    dtype: TorchDtype  # uint8 for UntypedStorage

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __setstate__(self, state):  # shared constants: see TorchDtype
        raise UnsafePickleError(f"pickle tried to set the state of {self!r}")

    def __reduce__(self):
        return StorageType, (self.name, self.dtype)


_STORAGE_DTYPES = {  # pytorch/pytorch: torch/storage.py `_dtype_to_storage_type_map`
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
}


@dataclass(frozen=True, eq=False, slots=True)
class Storage:
    """`nbytes` bytes at absolute byte `offset` of `source`, typed `dtype` (shared by views)."""

    source: ByteSource
    offset: int
    nbytes: int
    dtype: TorchDtype
    what: str

    def __setstate__(self, state):  # checked against its zip entry: a pickle must not move it
        raise UnsafePickleError(f"{self.what}: pickle tried to set the state of a storage")


StorageResolver = Callable[[str, TorchDtype, int, object], Storage]
"""`resolve(key, dtype, nbytes, view)`: where the container keeps storage `key`."""


# -- tensors ---------------------------------------------------------------------------------


def _np_dtype(dtype: TorchDtype, what: str) -> np.dtype:
    if dtype.numpy is None:
        raise FormatError(f"{what}: torch.{dtype.name} tensors have no numpy dtype to read into")
    return dtype.numpy


def _view(what: str, storage, dtype, storage_offset, size, stride) -> LazyTensor:
    if not isinstance(storage, Storage):
        raise FormatError(
            f"{what}: a tensor is rebuilt from {type(storage).__name__}, not a storage"
        )
    if not isinstance(dtype, TorchDtype):
        raise FormatError(f"{storage.what}: tensor dtype {dtype!r} is not a torch dtype")
    np_dtype = _np_dtype(dtype, storage.what)
    return stored_strided(
        storage.source,
        storage.offset,
        storage.nbytes // np_dtype.itemsize,
        np_dtype,
        tuple(size),
        tuple(stride),
        int(storage_offset),
        what=storage.what,
    )


def _check_metadata(what: str, metadata) -> None:
    if metadata and any(bool(v) for v in dict(metadata).values()):
        raise FormatError(
            f"{what}: tensor with conjugate/negative bits {metadata!r} is not supported"
        )


class _Rebuilder(Frozen):
    """A torch rebuild function bound to the file name used in its errors."""

    __slots__ = ("what",)

    def __init__(self, what: str, fn: Callable):
        super().__init__(fn)
        object.__setattr__(self, "what", what)

    def __call__(self, *args):
        return self.fn(self.what, *args)


def _rebuild_tensor(what, storage, storage_offset, size, stride):
    return _view(what, storage, getattr(storage, "dtype", None), storage_offset, size, stride)


def _rebuild_tensor_v2(
    what, storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None
):
    _check_metadata(what, metadata)
    return _view(what, storage, getattr(storage, "dtype", None), storage_offset, size, stride)


def _rebuild_tensor_v3(
    what, storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None
):
    _check_metadata(what, metadata)
    return _view(what, storage, dtype, storage_offset, size, stride)


def _rebuild_parameter(what, data, requires_grad=True, hooks=None):
    return data


def _rebuild_parameter_with_state(what, data, requires_grad, hooks, state):
    return data


def _rebuild_from_type_v2(what, func, new_type, args, state):
    if not isinstance(func, _Rebuilder):
        raise FormatError(f"{what}: _rebuild_from_type_v2 with {type(func).__name__}")
    return func(*args)


def _rebuild_from_numpy(what, data, dtype=None, device=None, requires_grad=False):
    if not isinstance(data, np.ndarray):
        raise FormatError(f"{what}: device tensor rebuilt from {type(data).__name__}")
    return ArrayTensor(data)


def _rebuild_from_cpu_tensor(what, data, dtype=None, device=None, requires_grad=False):
    if not isinstance(data, LazyTensor):
        raise FormatError(f"{what}: device tensor rebuilt from {type(data).__name__}")
    return data


def _unsupported(kind: str):
    def fn(what, *args):
        raise FormatError(f"{what}: {kind} tensors are not supported")

    return fn


# what `torch.Tensor` / `torch.nn.Parameter` resolve to: only a tag for `_rebuild_from_type_v2`
TENSOR_TYPE = Token("torch.Tensor")


def _bound(fn) -> Contextual:
    return Contextual(lambda up: _Rebuilder(up.what, fn))


def _tensor_names() -> dict[tuple[str, str], object]:
    out: dict[tuple[str, str], object] = {}
    fns = {
        "_rebuild_tensor": _rebuild_tensor,
        "_rebuild_tensor_v2": _rebuild_tensor_v2,
        "_rebuild_tensor_v3": _rebuild_tensor_v3,
        "_rebuild_parameter": _rebuild_parameter,
        "_rebuild_parameter_with_state": _rebuild_parameter_with_state,
        "_rebuild_device_tensor_from_numpy": _rebuild_from_numpy,
        "_rebuild_device_tensor_from_cpu_tensor": _rebuild_from_cpu_tensor,
        "_rebuild_qtensor": _unsupported("quantized"),
        "_rebuild_sparse_tensor": _unsupported("sparse"),
        "_rebuild_sparse_csr_tensor": _unsupported("sparse"),
        "_rebuild_nested_tensor": _unsupported("nested"),
        "_rebuild_wrapper_subclass": _unsupported("wrapper-subclass"),
        "_rebuild_meta_tensor_no_storage": _unsupported("meta (no data)"),
    }
    for n, fn in fns.items():
        out[("torch._utils", n)] = _bound(fn)
    for mod in ("torch._tensor", "torch.tensor"):  # torch maps the old name torch.tensor
        out[(mod, "_rebuild_from_type_v2")] = _bound(_rebuild_from_type_v2)
        out[(mod, "Tensor")] = TENSOR_TYPE
    out[("torch", "Tensor")] = TENSOR_TYPE
    out[("torch.nn.parameter", "Parameter")] = TENSOR_TYPE
    out[("torch.nn.parameter", "Buffer")] = TENSOR_TYPE
    for cls, dt in _STORAGE_DTYPES.items():
        st = StorageType(cls, TORCH_DTYPES[dt])
        for mod in ("torch", "torch.cuda", "torch.storage"):
            out[(mod, cls)] = st
    return out


TORCH_SAVE_POLICY = TORCH_POLICY.merged(Policy(MappingProxyType(_tensor_names())))
"""TORCH_POLICY plus tensor rebuild functions and storage classes."""


# -- the unpickler ---------------------------------------------------------------------------


class _TorchUnpickler(RestrictedUnpickler):
    """Resolves storage persistent ids through `resolve(key, dtype, nbytes, view)`."""

    def __init__(self, file, policy, *, what, resolve: StorageResolver):
        super().__init__(file, policy, what=what)
        self._resolve = resolve

    def persistent_load(self, pid):
        if (
            not isinstance(pid, tuple)
            or len(pid) not in (5, 6)
            or pid[0] not in ("storage", b"storage")
        ):
            return super().persistent_load(pid)
        stype, key, _location, numel = pid[1:5]
        view = pid[5] if len(pid) == 6 else None
        if isinstance(key, bytes):
            key = key.decode("ascii")
        if not isinstance(stype, StorageType):
            raise FormatError(
                f"{self.what}: storage {key!r} has type {stype!r}, not a torch storage"
            )
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise FormatError(f"{self.what}: bad storage id {pid!r}")
        return self._resolve(key, stype.dtype, numel * stype.dtype.itemsize, view)


def unpickle_tensors(data: bytes, what: str, policy: Policy, resolve: StorageResolver) -> object:
    """Unpickle a torch.save pickle under `policy`, storages placed by `resolve`."""
    return safe_loads(data, policy, what=what, unpickler_cls=_TorchUnpickler, resolve=resolve)
