"""The reference definition of `hybridckpt.checksum`, written plainly: a test oracle.

The library computes the same values with `hybridckpt.checksum.box_part` (run-wise, in place,
about 40x faster); tests check the two agree bit for bit on random shapes, boxes and dtypes.

Per-tensor checksums that do not depend on how a tensor is sharded.

checksum(T) = sum over elements i of mix(i, bits(T[i])) mod 2^64, where i is the global C-order
flat index, bits the element's raw bits (zero-extended to 64) and mix is splitmix64's finaliser
of `i * 0x9E3779B97F4A7C15 ^ bits`. Because it is a sum, every device's box adds its own part
(boxes holding the same data are counted once), so an import computes it from the boxes it
reads anyway, and `verify` recomputes it from any mesh. A flipped bit or two swapped elements
change it (with probability 1 - 2^-64 for random damage); it is not a cryptographic hash.
"""

from __future__ import annotations

import binascii
import itertools
import math

import numpy as np

from hybridckpt.lazy import Box

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 20  # elements per vectorised step (bounds the temporary memory)


def _bits(x: np.ndarray) -> np.ndarray:
    """Raw bits of every element as uint64 (C order)."""
    x = np.ascontiguousarray(x).reshape(-1)
    size = x.dtype.itemsize
    if size not in (1, 2, 4, 8):
        raise ValueError(f"no checksum for dtype {x.dtype}")
    return x.view(f"u{size}").astype(np.uint64)


def _mix(idx: np.ndarray, bits: np.ndarray) -> np.ndarray:
    z = (idx * _GOLDEN) ^ bits
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def box_part(shape: tuple[int, ...], box: Box, data: np.ndarray) -> int:
    """The part of the checksum of a tensor of `shape` that the elements `data` at `box` add."""
    if data.size == 0:
        return 0
    bits = _bits(data)
    with np.errstate(over="ignore"):
        if not shape:
            return int(_mix(np.zeros(1, np.uint64), bits).sum(dtype=np.uint64))
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        # flat global offsets of one leading row of the box, then row by row in chunks
        inner = np.zeros(1, dtype=np.uint64)
        for (a, b), s in zip(box[1:], strides[1:], strict=True):
            step = np.arange(a, b, dtype=np.uint64) * np.uint64(s)
            inner = (inner[:, None] + step[None, :]).reshape(-1)
        total = 0
        n_inner = inner.size
        a0, b0 = box[0]
        rows_per = max(1, _CHUNK // max(1, n_inner))
        for r in range(a0, b0, rows_per):
            r1 = min(b0, r + rows_per)
            rows = np.arange(r, r1, dtype=np.uint64) * np.uint64(strides[0])
            idx = (rows[:, None] + inner[None, :]).reshape(-1)
            part = bits[(r - a0) * n_inner : (r1 - a0) * n_inner]
            total = (total + int(_mix(idx, part).sum(dtype=np.uint64))) & _MASK
    return total


def _splitmix64(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)


def chunks(x: np.ndarray, chunk: tuple[int, ...]) -> int:
    """The `CHUNKS` checksum written plainly: every box of the grid of `chunk` over `x` (clipped
    at the edge), numbered in C order over the grid, adds splitmix64(number << 32 | CRC-32 of
    the box's C-order bytes), mod 2^64 (binascii's CRC-32, not the library's zlib call)."""
    total = 0
    counts = [math.ceil(n / c) for n, c in zip(x.shape, chunk, strict=True)]
    for number, pos in enumerate(itertools.product(*(range(k) for k in counts))):
        index = tuple(slice(p * c, (p + 1) * c) for p, c in zip(pos, chunk, strict=True))
        crc = binascii.crc32(np.ascontiguousarray(x[index]).tobytes())
        total = (total + _splitmix64(number * 2**32 + crc)) % 2**64
    return total
