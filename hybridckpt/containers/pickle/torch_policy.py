"""Torch names every pickle reader meets outside tensors: `TORCH_POLICY`.

Torch pickles name its dtypes as globals (`torch.float32`; pytorch/pytorch:
torch/_weights_only_unpickler.py `_get_allowed_globals`), sizes as `torch.Size(dims)`, devices
as `torch.device(kind[, index])`, and layouts and memory formats either as globals
(`torch.strided`) or through `torch.serialization._get_layout("torch.strided")`. They become:
- a dtype: a `TorchDtype` carrying its itemsize (bytes) and numpy dtype (bfloat16 and float8
  via ml_dtypes; None for quantized, complex32 and packed sub-byte types);
- `torch.Size`: a tuple of ints; `torch.device`: the string `"cuda:0"`;
- a layout or memory format: the string `"torch.<name>"`.

Framework code a checkpoint pickles (Megatron args, DeepSpeed and Colossal-AI objects, RNG
generators, `signal.Signals`) becomes inert stubs (`FRAMEWORK_STUBS`). Tensors and storages
are `torch_tensors`' concern.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import ml_dtypes
import numpy as np

from hybridckpt.containers.pickle.allow import Frozen, Policy, short_repr
from hybridckpt.containers.pickle.base_policy import BASE_ALLOWED
from hybridckpt.errors import FormatError, UnsafePickleError


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
        raise FormatError(f"unknown torch layout {short_repr(name)}")
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

TORCH_POLICY = Policy(MappingProxyType({**BASE_ALLOWED, **TORCH_ALLOWED}), FRAMEWORK_STUBS)
"""BASE_POLICY plus torch dtypes/Size/device and framework stubs (tensors: see torch_tensors)."""
