"""O_DIRECT writes: 4 KiB-aligned buffers, and the filesystems that refuse them.

A write with `O_DIRECT` goes from the process's memory to the device with no copy into the page
cache. That copy was the largest system-time cost of an import (0.5-1.0 CPU-s per GiB on 2 cores)
and what varied most between runs: on the 2-core VM the benchmarks run on, a buffered write of 1.1
GiB took 0.8 to 2.7 s from run to run (the kernel's copy into fresh page-cache pages, 32% of an
export's samples in the slow runs), against 0.28-0.35 s for the same bytes written direct. A
converter's output is also rarely read back from the page cache (a restore runs elsewhere, or
later), and writing it there evicts what the machine had cached.

The rules: buffer address, length and file offset are multiples of DIRECT_ALIGN (`aligned_empty`
gives such buffers). A filesystem that refuses O_DIRECT (EINVAL at open or at write: tmpfs before
Linux 6.6, some network filesystems) is remembered by device, and written buffered for the rest of
the process. Users: `containers.orbax.chunk_files` (an import's raw chunks) and `io.sequential_file` (the
safetensors files of an export).
"""

from __future__ import annotations

import errno
import math
import os

import numpy as np

DIRECT_ALIGN = 4096  # bytes: O_DIRECT's alignment of buffer address, length and file offset
_REFUSAL = {errno.EINVAL, errno.EOPNOTSUPP}
_refused: set[int] = set()  # st_dev of filesystems that refused O_DIRECT in this process


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a DIRECT_ALIGN boundary."""
    dtype, count = np.dtype(dtype), math.prod(shape)
    raw = np.empty(count * dtype.itemsize + DIRECT_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN
    return raw[start : start + count * dtype.itemsize].view(dtype).reshape(shape)


def _device(path: str) -> int | None:
    try:
        return os.stat(os.path.dirname(os.path.abspath(path))).st_dev
    except OSError:
        return None


def open_direct(path: str, flags: int, mode: int = 0o644) -> int | None:
    """`os.open(path, flags | O_DIRECT, mode)`, or None (nothing opened) where the platform has no
    O_DIRECT or the filesystem of `path`'s folder refused it (then remembered)."""
    dev = _device(path)
    if not hasattr(os, "O_DIRECT") or dev is None or dev in _refused:
        return None
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as e:
        if e.errno in _REFUSAL:
            _refused.add(dev)
            return None
        raise


def refused(path: str, error: OSError) -> bool:
    """Whether `error`, raised by a write with O_DIRECT to `path`, is its filesystem refusing
    O_DIRECT (remembered: that filesystem is written buffered from now on)."""
    if error.errno not in _REFUSAL:
        return False
    dev = _device(path)
    if dev is not None:
        _refused.add(dev)
    return True

