"""`box_part` of `hybridckpt.checksum`, computed fast: the same value, bit for bit.

The definition is `hybridckpt.checksum`'s: the sum over the box's elements of
`mix(i, bits)` mod 2^64, `i` the global C-order flat index. This version walks the box as its
maximal contiguous runs (`lazy.box_runs`) in blocks of `BLOCK` elements, using two preallocated
uint64 buffers and in-place numpy ops (so the working set stays in cache), and derives
`i * GOLDEN` as `start * GOLDEN + j * GOLDEN` (mod 2^64) without materialising the indices.
`checksum.box_part` builds every index of a box's trailing dims at once: for a per-layer tile
`[1, rows, cols]` that is one temporary of the whole tile, about 40x slower (measured on
`[1, 2048, 5632]` bf16: 0.02 vs 0.7 GB/s on one core). tests/test_streaming.py checks both agree.
"""

from __future__ import annotations

import numpy as np

from hybridckpt import checksum
from hybridckpt.lazy import Box, box_runs

BLOCK = 1 << 16  # elements per vectorised pass: 2 x 512 KiB of uint64 work buffers
_MASK = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15
_GOLDEN = np.uint64(_G)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix_sum(z: np.ndarray, t: np.ndarray) -> int:
    """splitmix64's finaliser of every element of `z` (in place, `t` scratch), summed mod 2^64."""
    np.right_shift(z, _S30, out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, _M1, out=z)
    np.right_shift(z, _S27, out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, _M2, out=z)
    np.right_shift(z, _S31, out=t)
    np.bitwise_xor(z, t, out=z)
    return int(z.sum(dtype=np.uint64))


def box_part(shape: tuple[int, ...], box: Box, data: np.ndarray) -> int:
    """`checksum.box_part(shape, box, data)`, the part the elements `data` at `box` add."""
    if data.size == 0:
        return 0
    if not shape:
        return checksum.box_part(shape, box, data)
    flat = np.ascontiguousarray(data).reshape(-1)
    size = flat.dtype.itemsize
    if size not in (1, 2, 4, 8):
        raise ValueError(f"no checksum for dtype {flat.dtype}")
    bits = flat.view(f"u{size}")
    starts, run_len = box_runs(tuple(shape), box)
    z = np.empty(min(BLOCK, max(run_len, 1) * len(starts)), dtype=np.uint64)
    t = np.empty_like(z)
    total = 0
    with np.errstate(over="ignore"):
        if run_len >= BLOCK:  # long runs: blocks inside each run
            steps = np.arange(BLOCK, dtype=np.uint64) * _GOLDEN
            pos = 0
            for s in starts.tolist():
                for off in range(0, run_len, BLOCK):
                    m = min(BLOCK, run_len - off)
                    zz, tt = z[:m], t[:m]
                    np.add(steps[:m], np.uint64(((s + off) * _G) & _MASK), out=zz)
                    np.bitwise_xor(zz, bits[pos : pos + m], out=zz)
                    total += _mix_sum(zz, tt)
                    pos += m
        else:  # short runs: several whole runs per block
            per = max(1, BLOCK // run_len)
            steps = np.arange(run_len, dtype=np.uint64) * _GOLDEN
            ustarts = starts.astype(np.uint64) * _GOLDEN
            for r in range(0, len(starts), per):
                rs = ustarts[r : r + per]
                m = len(rs) * run_len
                zz, tt = z[:m], t[:m]
                np.add(rs[:, None], steps[None, :], out=zz.reshape(len(rs), run_len))
                np.bitwise_xor(zz, bits[r * run_len : r * run_len + m], out=zz)
                total += _mix_sum(zz, tt)
    return total & _MASK
