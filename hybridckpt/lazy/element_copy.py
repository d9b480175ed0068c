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
1.63 and 1.77 (the GIL between). (Measured with strips of 128; 256 since: see STRIP_ROWS.) Bit for bit the same result: `tests/store/test_streaming.py`.

The strip loop (`transposed_rows`) takes what fills the staging rows as a function: a copy out of
an array in memory (`copy_into`), or a read of the file's rows straight into them
(`lazy.StoredTensor`: the transposed tiles of an import, no slab buffer, no copy into the stage,
`tests/lazy/test_staged_reads.py`). Each thread keeps its staging buffer (`stage_rows`, up to
STAGE_KEEP_BYTES) instead of making one a copy, until a save ends (`release_stages`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from hybridckpt.io.byte_source import planned

STRIP_ROWS = 256  # indices along out's contiguous axis moved per strip (a column: 256 lines, 16 KiB of L1).
# 256 against 128 (the `[in, out]` tiles of an fp32 import, read and transposed, CPU-s interleaved on
# the 2-core VM under load): 1.12-1.26x the elements a CPU-second; the copy alone 1.1-1.45x (each
# `out` row written in runs of 1 KiB, not 512 B; half the numpy calls, preadvs and Python a strip)
PAD_BYTES = 64  # the staging rows' padding: one cache line
STAGED_MAX_OUTER = 256  # at most this many 2-D slices (over the other axes) are staged one by one


def too_small(out: np.ndarray) -> bool:
    """Whether `out` is too small for strips (under a quarter of STRIP_ROWS squared elements:
    128 x 128): numpy's own copy then."""
    return out.size < STRIP_ROWS * STRIP_ROWS // 4


def fastest_axis(x: np.ndarray) -> int:
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
    if out.ndim < 2 or src.shape != out.shape or too_small(out) or (
            out.shape[-1] > 1 and out.strides[-1] == out.itemsize and src.strides[-1] == src.itemsize):
        np.copyto(out, src, casting="unsafe")  # (numpy's own: small, or rows to rows)
        return
    a, b = fastest_axis(out), fastest_axis(src)
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
    """The transposing copy of an array in memory: `transposed_rows` with each strip's rows
    copied out of `src` into the staging rows."""
    if out.dtype == src.dtype and out.dtype.itemsize in (1, 2, 4, 8):
        out, src = _as_bits(out), _as_bits(src)

    def fill(rest: tuple[int, ...], i: int, rows: np.ndarray) -> None:
        idx: list = [slice(None)] * src.ndim
        for d, r in zip(others, rest, strict=True):
            idx[d] = r
        idx[a] = slice(i, i + rows.shape[0])
        part = src[tuple(idx)]  # 2-D, axes in the order (min(a, b), max(a, b))
        np.copyto(rows if a < b else rows.T, part)

    transposed_rows(out, src.dtype, a, b, fill)


RowFill = Callable[[tuple[int, ...], int, np.ndarray], None]


def transposed_rows(out: np.ndarray, src_dtype, a: int, b: int, fill: RowFill) -> None:
    """`out[...] =` a source contiguous along axis `b`, where `out` is contiguous along `a` (a
    transposing copy), strip by strip: for each index `rest` of the other axes (at most
    STAGED_MAX_OUTER of them) and each strip of STRIP_ROWS indices from `i` along `a`,
    `fill(rest, i, rows)` puts the source's elements there into `rows` (`[k, n]`, of
    `src_dtype`: row `r` the source's line at index `i + r` along `a`, over the `n` indices
    along `b`; the rows of the padded staging buffer, `stage_rows`), then one numpy copy moves
    them into `out` (casting as `copy_into` does). `fill` copies them out of an array in memory
    (`copy_into`) or reads them from a file straight into the staging rows (`lazy.StoredTensor`:
    no buffer of the whole box, no copy into the staging). Under a read plan
    (`io.byte_source.planning`) `fill` is called (the reads are counted) but nothing is copied."""
    src_dtype = np.dtype(src_dtype)
    if out.dtype == src_dtype and out.dtype.itemsize in (1, 2, 4, 8):
        out, src_dtype = _as_bits(out), np.dtype(f"u{src_dtype.itemsize}")
    others = [d for d in range(out.ndim) if d not in (a, b)]
    h, n = min(STRIP_ROWS, out.shape[a]), out.shape[b]
    dry = planned()
    with stage_rows(h, n, src_dtype) as stage:
        for rest in np.ndindex(*(out.shape[d] for d in others)):
            idx: list = [slice(None)] * out.ndim
            for d, r in zip(others, rest, strict=True):
                idx[d] = r
            o2 = out[tuple(idx)]  # 2-D, axes in the order (min(a, b), max(a, b))
            for i in range(0, out.shape[a], h):
                rows = stage[: min(h, out.shape[a] - i)]
                fill(rest, i, rows)
                if not dry:
                    part = (slice(i, i + len(rows)), slice(None)) if a < b else (slice(None), slice(i, i + len(rows)))
                    np.copyto(o2[part], rows if a < b else rows.T, casting="unsafe")


STAGE_KEEP_BYTES = 8 << 20  # a thread keeps its staging buffer up to this size (reused strip after strip):
# 256 fp32 rows of 5632 (the `in` of a SwiGLU down_proj) are 5.8 MB
_lock = threading.Lock()
_kept: dict[int, dict] = {}  # thread id -> {"stage": its staging buffer (uint8) or None, "busy": lent}


@contextmanager
def stage_rows(h: int, n: int, dtype) -> Iterator[np.ndarray]:
    """`[h, n]` of `dtype`, rows PAD_BYTES (at least one element) longer than `n` elements, so a
    walk down a column touches every cache set (rows a power of two apart map to the same one).
    Lent from this thread's buffer (kept up to STAGE_KEEP_BYTES, until `release_stages`): no
    fresh pages strip after strip, box after box."""
    dtype = np.dtype(dtype)
    pad = max(1, PAD_BYTES // dtype.itemsize)
    need = h * (n + pad) * dtype.itemsize
    with _lock:
        mine = _kept.setdefault(threading.get_ident(), {"stage": None, "busy": False})
        lent = not mine["busy"] and need <= STAGE_KEEP_BYTES
        if lent:
            mine["busy"] = True
            if mine["stage"] is None or len(mine["stage"]) < need:
                mine["stage"] = np.empty(max(need, 1 << 20), np.uint8)
                stage_allocations[0] += 1
            raw = mine["stage"]
    if not lent:
        raw = np.empty(need, np.uint8)
    try:
        yield raw[:need].view(dtype).reshape(h, n + pad)[:, :n]
    finally:
        if lent:
            with _lock:
                mine["busy"] = False


def release_stages() -> None:
    """Drop every thread's kept staging buffer that is not lent now (a save is over:
    `store.stream`); the next transposing copy of a thread makes one again."""
    with _lock:
        for tid in list(_kept):
            if not _kept[tid]["busy"]:
                del _kept[tid]


def kept_stage_bytes() -> int:
    """Bytes of the staging buffers the threads keep (tests count them)."""
    with _lock:
        return sum(len(k["stage"]) for k in _kept.values() if k["stage"] is not None)


stage_allocations = [0]  # staging buffers a thread made to keep (tests count them)
