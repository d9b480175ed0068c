"""The one element copy every lazy view ends in: `copy_into(out, src)`, fast when it transposes.

`out[...] = src` with numpy's unsafe casting (the same rounding as `astype`). Most copies are
plain (both arrays contiguous along the same axis) and go to `np.copyto`. A transposing copy (a
`[out, in]` weight read into a transposed view of an `[in, out]` buffer: the two arrays contiguous
along different axes) is where an import spends its user time, and numpy's strided element loop
is slow on it: rows of a large array lie a power of two apart (4 KiB for 2048 bf16), so a column
walk maps every row to the same cache set (0.17 G elements/s for bf16 `[5632, 2048]`).

So the copy moves strips of STRIP_ROWS indices along `out`'s contiguous axis: each strip is first
copied out of `src` (contiguous runs) into a staging buffer whose rows are one cache line longer
than the data (so a column walk spreads over every cache set), then from there into `out` by one
numpy copy, which walks the staged columns from L1 and writes `out` in contiguous runs (and
casts). Two large numpy calls per strip: the GIL is held for microseconds per strip, so reader
threads copy in parallel. On bf16 `[5632, 2048]`: 2.2-2.7 G elements/s on one thread, 3-4.4 on
two (fp32: 1.5 and 2.5); the square 128-element tiles staged three calls each before reached
1.63 and 1.77 (the GIL between). Bit for bit the same result: `tests/store/test_streaming.py`.
"""

from __future__ import annotations

import math

import numpy as np

from hybridckpt.io.byte_source import planned

STRIP_ROWS = 128  # indices along out's contiguous axis moved per strip (its columns stay in L1)
PAD_BYTES = 64  # the staging rows' padding: one cache line
STAGED_MAX_OUTER = 256  # at most this many 2-D slices (over the other axes) are staged one by one


def _fastest_axis(x: np.ndarray) -> int:
    """The axis (of length > 1) with the smallest stride: the one contiguous in memory."""
    axes = [i for i, n in enumerate(x.shape) if n > 1]
    return min(axes, key=lambda i: abs(x.strides[i])) if axes else x.ndim - 1


def copy_into(out: np.ndarray, src: np.ndarray) -> None:
    """`out[...] = src` (numpy's unsafe casting: the same rounding as `astype`); a transposing
    copy moves padded strips (see the module doc). Under a read plan (`io.byte_source.planning`)
    the buffers hold no file bytes: the shapes are checked as numpy would, nothing is copied."""
    if planned():
        np.broadcast_shapes(src.shape, out.shape)
        return
    if out.ndim < 2 or out.size < STRIP_ROWS * STRIP_ROWS or src.shape != out.shape:
        np.copyto(out, src, casting="unsafe")
        return
    a, b = _fastest_axis(out), _fastest_axis(src)
    if a == b:
        np.copyto(out, src, casting="unsafe")
        return
    others = [d for d in range(out.ndim) if d not in (a, b)]
    if math.prod(out.shape[d] for d in others) <= STAGED_MAX_OUTER:
        _strips(out, src, a, b, others)
        return
    idx = [slice(None)] * out.ndim  # many slices: plain square tiles over the two axes
    for i in range(0, out.shape[a], STRIP_ROWS):
        idx[a] = slice(i, i + STRIP_ROWS)
        for j in range(0, out.shape[b], STRIP_ROWS):
            idx[b] = slice(j, j + STRIP_ROWS)
            k = tuple(idx)
            np.copyto(out[k], src[k], casting="unsafe")


def _as_bits(x: np.ndarray) -> np.ndarray:
    """`x` viewed as unsigned integers of its width (any strides)."""
    return x.view(f"u{x.dtype.itemsize}")


def _strips(out: np.ndarray, src: np.ndarray, a: int, b: int, others: list[int]) -> None:
    """The transposing copy over axes `a` (out's contiguous one) and `b` (src's), one 2-D slice
    of the `others` axes at a time, strip by strip through a padded staging buffer."""
    if out.dtype == src.dtype and out.dtype.itemsize in (1, 2, 4, 8):
        out, src = _as_bits(out), _as_bits(src)
    h, n = min(STRIP_ROWS, out.shape[a]), src.shape[b]  # (the buffer: at most the 2-D slice)
    pad = max(1, PAD_BYTES // src.dtype.itemsize)
    stage = np.empty((h, n + pad), dtype=src.dtype)  # [strip index along a, index along b]
    for rest in np.ndindex(*(out.shape[d] for d in others)):
        idx: list = [slice(None)] * out.ndim
        for d, r in zip(others, rest, strict=True):
            idx[d] = r
        o2, s2 = out[tuple(idx)], src[tuple(idx)]  # 2-D, axes in the order (min(a, b), max(a, b))
        a_first = a < b
        for i in range(0, o2.shape[0 if a_first else 1], h):
            k = min(h, o2.shape[0 if a_first else 1] - i)
            staged = stage[:k, :n] if a_first else stage[:k, :n].T  # laid out like src: b fastest
            part = (slice(i, i + k), slice(None)) if a_first else (slice(None), slice(i, i + k))
            np.copyto(staged, s2[part])
            np.copyto(o2[part], staged, casting="unsafe")
