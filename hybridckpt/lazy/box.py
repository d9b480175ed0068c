"""Boxes: the regions of a global tensor that lazy tensors read.

A box is a tuple of `(start, stop)` pairs, one per dimension, in global element coordinates
(`Box`); `((0, 4), (2, 3))` of a `[4, 8]` tensor is column 2. An empty range (`start == stop`)
is a box of zero elements. These helpers are pure: they map boxes to shapes, to C-order flat
element runs and ranges (row-major, last dimension fastest), and boxes onto the blocks that tile
a tensor (tensor-parallel shards, DCP chunks).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

Box = tuple[tuple[int, int], ...]

# Bounds on a shape read from a checkpoint file (`shape_problem`): far beyond any real tensor,
# small enough that no loop over dims, divisor search or size product misbehaves.
MAX_RANK = 16  # dims (numpy allows 64; no model tensor has more than 6)
MAX_DIM = 1 << 40  # elements along one dim
MAX_ELEMENTS = 1 << 44  # elements of one tensor (64 TiB of fp32)


def shape_problem(shape: object) -> str | None:
    """Why `shape` (read from an untrusted file) is not a shape to plan or read, or None: it
    must be a sequence of at most MAX_RANK non-negative ints, each at most MAX_DIM, whose product
    of the non-zero dims is at most MAX_ELEMENTS (a zero-size tensor may not hide a 2^64 dim)."""
    if not isinstance(shape, tuple | list):
        return f"shape {shape!r:.80} is not a list of ints"
    if len(shape) > MAX_RANK:
        return f"shape has {len(shape)} dims (at most {MAX_RANK})"
    for n in shape:
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 0:
            return f"shape {list(shape)!r:.120} has a dim that is not a non-negative int"
        if n > MAX_DIM:
            return f"shape has a dim of {int(n)} (at most {MAX_DIM})"
    if math.prod(int(n) for n in shape if n) > MAX_ELEMENTS:
        return f"shape {[int(n) for n in shape]} holds more than {MAX_ELEMENTS} elements"
    return None


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def normalize_box(shape: Sequence[int], index) -> Box:
    """Turn a tuple of slices (as `jax.make_array_from_callback` passes) into a Box."""
    if index is None:
        return full_box(shape)
    if not isinstance(index, tuple):
        index = (index,)
    index = index + (slice(None),) * (len(shape) - len(index))
    box = []
    for s, n in zip(index, shape, strict=True):
        if isinstance(s, slice):
            a, b, step = s.indices(n)
            if step != 1:
                raise ValueError(f"strided index {s} is not a box")
            box.append((a, max(a, b)))
        else:
            i = int(s) % n
            box.append((i, i + 1))
    return tuple(box)


def check_box(shape: Sequence[int], box: Box) -> None:
    """Raise ValueError unless `box` lies inside `shape` (one range per dimension)."""
    shape = tuple(shape)
    if len(box) != len(shape):
        raise ValueError(f"box {box} is outside shape {shape}")
    for (a, b), n in zip(box, shape, strict=True):  # a loop, not any(genexpr): views come by the 10k
        if not (0 <= a <= b <= n):
            raise ValueError(f"box {box} is outside shape {shape}")


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[Box]:
    """Boxes (at most 2*ndim) that cover the C-order flat range `[start, stop)` of `shape`, in order."""
    if start >= stop:
        return
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        for b in flat_boxes(rest, c0, c1):
            yield ((r0, r0 + 1),) + b
        return
    if c0:
        for b in flat_boxes(rest, c0, inner):
            yield ((r0, r0 + 1),) + b
        r0 += 1
    if r1 > r0:
        yield ((r0, r1),) + full_box(rest)
    if c1:
        for b in flat_boxes(rest, 0, c1):
            yield ((r1, r1 + 1),) + b


def box_runs(shape: Sequence[int], box: Box) -> tuple[np.ndarray, int]:
    """The C-order flat runs of `box` inside `shape`: (run start indices [n_runs], run length).

    Runs are maximal: trailing dimensions the box covers fully are merged into one run.
    """
    nd = len(shape)
    if nd == 0:
        return np.zeros(1, dtype=np.int64), 1
    if any(b == a for a, b in box):
        return np.zeros(0, dtype=np.int64), 0
    k = nd - 1  # the last dimension the box does not cover fully, walking from the right
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1 :])
    run_len = (box[k][1] - box[k][0]) * inner
    strides = [math.prod(shape[i + 1 :]) for i in range(nd)]
    starts = np.array([box[k][0] * strides[k]], dtype=np.int64)
    for i in range(k - 1, -1, -1):
        a, b = box[i]
        offs = np.arange(a, b, dtype=np.int64) * strides[i]
        starts = (offs[:, None] + starts[None, :]).reshape(-1)
    return starts, run_len


def one_run(shape: Sequence[int], box: Box) -> int | None:
    """The C-order flat index of `box`'s first element inside `shape` when its elements are one
    run there (every axis before the first it takes more than one index of has one index, every
    axis after it is whole), else None (an empty box too). `box_runs` without numpy: a restore
    asks it for each of the ~1k pieces it reads a GB."""
    start, cut = 0, False
    for (a, b), n in zip(box, shape, strict=True):
        if b <= a:
            return None
        if cut and (a, b) != (0, n):
            return None
        cut = cut or b - a > 1
        start = start * n + a
    return start


def flat_ranges(shape: Sequence[int], box: Box, limit: int) -> list[tuple[int, int]] | None:
    """The C-order flat element ranges `[start, stop)` of `box` inside `shape`, touching runs
    merged; None when there are more than `limit`."""
    starts, run_len = box_runs(shape, box)
    if run_len == 0 or len(starts) == 0:
        return []
    breaks = np.flatnonzero(np.diff(starts) != run_len) + 1
    if len(breaks) + 1 > limit:
        return None
    edges = [0, *breaks.tolist(), len(starts)]
    return [(int(starts[i]), int(starts[i]) + (j - i) * run_len) for i, j in zip(edges[:-1], edges[1:], strict=True)]


def grid_boxes(box: Box, chunk: Sequence[int]) -> Iterator[Box]:
    """The boxes of a grid of `chunk`-shaped blocks anchored at `box`'s start, clipped to `box`, in
    C order (a tile cut into its stored chunks; `full_box(shape)` for a whole tensor's grid)."""
    steps = [range(a, b, c) for (a, b), c in zip(box, chunk, strict=True)]
    for origin in itertools.product(*steps):
        yield tuple((o, min(o + c, b)) for o, c, (_, b) in zip(origin, chunk, box, strict=True))


def box_slices(box: Box, within: Box | None = None) -> tuple[slice, ...]:
    """numpy index of `box` in an array holding the global tensor (`within` None) or the box
    `within` (coordinates relative to its start)."""
    starts = [0] * len(box) if within is None else [a for a, _ in within]
    return tuple(slice(a - s, b - s) for (a, b), s in zip(box, starts, strict=True))


def block_overlap(box: Box, offsets: Sequence[int], block_shape: Sequence[int]) -> Box | None:
    """The part of `box` inside the block at `offsets` (global) of `block_shape`, in the block's
    own coordinates; None when they do not meet."""
    sub = []
    for (a, b), o, n in zip(box, offsets, block_shape, strict=True):
        s, e = max(a, o), min(b, o + n)
        if s >= e:
            return None
        sub.append((s - o, e - o))
    return tuple(sub)
