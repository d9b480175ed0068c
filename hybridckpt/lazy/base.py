"""The lazy tensor protocol: a global shape, a dtype, and `read_box(box)` that reads only that box.

Every view has `read_into(box, out)`, which fills a caller's preallocated array (C-order or a
strided view of one): chains of stored pieces, concatenations, stacks and slices land in one
buffer with no intermediate copies (`read_box` allocates that buffer and calls it). A subclass
implements either; each defaults to the other.

`file_runs(box, limit)` says where a box's bytes already lie in files (`FileRun`s, in C order,
little-endian), or None when the view computes them (casts, transposes, in-memory arrays); see
`hybridckpt.lazy.runs`.

`copy_into` (`lazy.element_copy`) is the one element copy every view ends in: numpy's unsafe
casting (the same rounding as `astype`), in staged square tiles when the copy transposes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import ByteSource, real_reads
from hybridckpt.lazy.box import Box, box_shape, check_box, flat_boxes, full_box, normalize_box
from hybridckpt.lazy.element_copy import copy_into


class FileRun(NamedTuple):
    """`nbytes` bytes at byte `offset` of `source`: a contiguous piece of a tensor's C-order bytes.
    `check`, where the bytes are our store's (`store.checked_runs.RunCheck`), must be fed the bytes
    (`check.feed(view)`) by whoever copies them, in order: it compares their CRC-32 with the one
    recorded at import once a chunk's last byte has passed."""

    source: ByteSource
    offset: int
    nbytes: int
    check: Any = None


class LazyTensor:
    """A global tensor whose boxes can be read on demand. Subclasses implement `read_box` (a
    fresh array) or `read_into` (into a caller's buffer), or both; each defaults to the other."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read_box(self, box: Box) -> np.ndarray:
        """The box as a new C-contiguous array (allocated here, filled by `read_into`)."""
        out = np.empty(box_shape(box), dtype=self.dtype)
        self.read_into(box, out)
        return out

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """Write the box into `out` (shape = the box's shape, dtype = `self.dtype`, any strides:
        views pass transposed views of the buffer down instead of copying twice)."""
        copy_into(out, self.read_box(box))

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        """The box's C-order little-endian bytes as at most `limit` runs of file bytes, or None
        when they are not stored that way (or need more runs)."""
        return None

    # -- conveniences -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def read(self, index=None) -> np.ndarray:
        """Read a box given as slices (or everything when `index` is None)."""
        box = normalize_box(self.shape, index)
        check_box(self.shape, box)
        return self.read_box(box)

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        """The C-order flat elements `[start, stop)` as a 1-D array."""
        parts = [self.read_box(b).reshape(-1) for b in flat_boxes(self.shape, start, stop)]
        if not parts:
            return np.empty(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def materialize(self) -> np.ndarray:
        """The whole tensor in memory (only where the user asked for a whole tensor)."""
        return self.read_box(full_box(self.shape))


class Deferred(LazyTensor):
    """A tensor whose storage is found on first use: `tensor()` parses and checks it (a chunk's
    own archive or record, against the metadata that promised its shape and dtype) and every read
    goes to what it returns. Subclasses implement `tensor()` and cache its result."""

    def tensor(self) -> LazyTensor:
        raise NotImplementedError

    def read_box(self, box: Box) -> np.ndarray:
        return self._found().read_box(box)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        self._found().read_into(box, out)

    def _found(self) -> LazyTensor:
        """`tensor()`, its storage parsed by real reads even while a read plan is made
        (`io.byte_source.planning`): the plan counts them, as the import reads them."""
        with real_reads():
            return self.tensor()

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        return self._found().file_runs(box, limit)


def scalar_value(t, where: str, what: str = "step") -> float:
    """The one number a scalar leaf holds (a step, a count), checked BEFORE it is read: a leaf
    declaring more than one element (a `step` of 2^33 elements would allocate 64 GiB to read it)
    is a FormatError naming `where`, `what`, its shape and dtype. `t` a LazyTensor, a numpy
    array or a plain number; read as float64."""
    if not isinstance(t, (LazyTensor, np.ndarray)):
        try:
            return float(t)
        except (TypeError, ValueError, OverflowError):
            raise FormatError(f"{where}: {what} should be a number, found {type(t).__name__}") from None
    shape = tuple(t.shape)
    if math.prod(shape) != 1:
        raise FormatError(
            f"{where}: {what} should hold one number, but it is declared {np.dtype(t.dtype)} "
            f"{list(shape)} ({math.prod(shape)} elements); not read"
        )
    value = t.materialize() if isinstance(t, LazyTensor) else t
    try:
        return float(np.asarray(value).reshape(-1)[0])
    except (TypeError, ValueError, OverflowError):
        raise FormatError(f"{where}: {what} of dtype {np.dtype(t.dtype)} is not a number") from None
