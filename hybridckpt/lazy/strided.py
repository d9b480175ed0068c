"""Torch-style strided views of a stored storage: `shape`, element `strides`, `storage_offset`.

torch saves a tensor as a view of a storage (pytorch/pytorch:torch/_utils.py
`_rebuild_tensor_v2(storage, storage_offset, size, stride)`); `stored_strided` turns such a view
into lazy views that read only its box when it is a transposition and/or narrowing of a
C-contiguous block, and reads the span it covers otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.lazy.base import LazyTensor
from hybridckpt.lazy.box import Box
from hybridckpt.lazy.constructors import reshape, transpose
from hybridckpt.lazy.stored import ArrayTensor, StoredTensor
from hybridckpt.lazy.views import Slice


def stored_strided(
    source: ByteSource,
    storage_byte_offset: int,
    storage_numel: int,
    dtype,
    shape: Sequence[int],
    strides: Sequence[int],
    storage_offset: int,
    *,
    what: str = "tensor",
) -> LazyTensor:
    """A tensor viewing a storage the way torch does: `shape`, element `strides`, `storage_offset`.

    The storage is `storage_numel` elements of `dtype` at byte `storage_byte_offset` of `source`.
    Views that are a transposition and/or narrowing of a C-contiguous block become
    `Transpose(Slice(StoredTensor))` and read only their box; any other stride pattern (broadcast,
    overlapping) reads the span it covers. Strides or offsets pointing outside the storage are a
    FormatError naming `what`.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    strides = tuple(int(s) for s in strides)
    if len(shape) != len(strides):
        raise FormatError(f"{what}: {len(shape)} dims but {len(strides)} strides")
    if any(s < 0 for s in shape) or any(s < 0 for s in strides) or storage_offset < 0:
        raise FormatError(f"{what}: negative size, stride or offset")
    numel = math.prod(shape)
    if numel:
        last = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        if last >= storage_numel:
            raise FormatError(
                f"{what}: view (offset {storage_offset}, shape {shape}, strides {strides}) reaches "
                f"element {last} but the storage has {storage_numel}"
            )
    base = storage_byte_offset + storage_offset * dtype.itemsize
    if numel == 0:
        return ArrayTensor(np.empty(shape, dtype=dtype))
    # keep dims with size > 1; order them by stride, outermost first
    dims = [i for i, n in enumerate(shape) if n > 1]
    order = sorted(dims, key=lambda i: -strides[i])
    parent: list[int] = []
    ok = True
    for pos, i in enumerate(order):
        inner_stride = strides[order[pos + 1]] if pos + 1 < len(order) else 1
        if pos + 1 == len(order):
            ok = ok and strides[i] == 1
        if pos == 0:
            parent.append(shape[i])
        if pos + 1 < len(order):
            j = order[pos + 1]
            if inner_stride == 0 or strides[i] % inner_stride:
                ok = False
                break
            ext = strides[i] // inner_stride
            if ext < shape[j]:
                ok = False
                break
            parent.append(ext)
    if ok:
        parent_shape = tuple(parent) if order else ()
        # elements of the parent block that must exist in the storage
        # the parent block may extend past the storage for a narrowed view; the Slice reads only
        # the view's elements, all of which were bounds-checked above
        stored = StoredTensor(source, base, parent_shape, dtype)
        region = tuple((0, shape[i]) for i in order)
        view: LazyTensor = Slice(stored, region) if order else stored
        # `view` has the dims in `order`; put them back in tensor order, then add size-1 dims
        if order:
            inv = [order.index(i) for i in dims]
            view = transpose(view, inv)
        return reshape(view, shape)
    # general strides: read the covered span, then view it
    span = last - storage_offset + 1
    flat = StoredTensor(source, base, (span,), dtype)
    return _AsStrided(flat, shape, strides)


@dataclass(frozen=True, eq=False)
class _AsStrided(LazyTensor):
    """An arbitrary strided view of a flat span (read whole: only for unusual views)."""

    flat: StoredTensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        return self.flat.dtype

    def read_box(self, box: Box) -> np.ndarray:
        data = self.flat.materialize()
        item = data.dtype.itemsize
        full = np.lib.stride_tricks.as_strided(
            data, shape=self.shape, strides=tuple(s * item for s in self.strides), writeable=False
        )
        return np.ascontiguousarray(full[tuple(slice(a, b) for a, b in box)])
