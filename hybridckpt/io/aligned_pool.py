"""Reusable 4 KiB-aligned buffers: the tiles of a raw import, read into and written from again.

An import reads each tile into a buffer that O_DIRECT writes from (`io.direct_io`: 4 KiB-aligned
address). A fresh buffer per tile is fresh memory per tile: the kernel zeroes every page on first
touch (`clear_page_erms`, 5% of an FSDP2 import's CPU samples on the 2-core VM) and faults it in,
then the allocator returns it or keeps it in one reader thread's arena, where the next tile of
another thread cannot use it (the import's peak RSS grew past the tiles in flight). `AlignedPool`
lends buffers instead: a tile borrows one (`lend`, a context manager) and gives it back once its
chunks are written; the next tile of about the same size reuses it, its pages already mapped.
A restore lends the same way its scratch pieces and the chunks it reads whole to cut (`borrow`:
given back by whichever thread cuts the chunk's last piece).

Bound: the buffers the pool holds, lent or free, are at most `limit` bytes (the save's in-flight
budget, `store.stream.INFLIGHT_BYTES`: its tiles' and a strip's copy a writer) plus what is lent beyond it (the budget lets one tile
larger than itself run alone): a free buffer is dropped before a new one would pass the limit.
`allocations` counts the fresh buffers made (tests count them, no timing). Thread-safe.

`unit` (bytes, default off): every request of at most `unit` bytes gets a buffer of exactly
`unit` (whole MiB), so any free one serves any such request. A restore's scratch pool lends pieces
and chunks of 0.25-8 MiB whose sizes change from array to array: matched within 2x and emptied
after each array, it made 78-98 fresh buffers (305-347 MiB, each faulted in and zeroed) for a
1.1-2.3 GB restore whose pool holds 64 MiB; with `unit` it makes at most what its limit holds.
`trim()` drops the free buffers that are not of `unit` size (`clear()`: every free one).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from hybridckpt.io.direct_io import DIRECT_ALIGN, aligned_empty

ROUND_BYTES = 1 << 20  # buffers of at least this are made in whole MiB (tiles of one leaf share them)


def _capacity(nbytes: int) -> int:
    """The size of the buffer made for `nbytes`: whole 4 KiB blocks, whole MiB from 1 MiB on."""
    step = ROUND_BYTES if nbytes >= ROUND_BYTES else DIRECT_ALIGN
    return max(step, -(-nbytes // step) * step)


class AlignedPool:
    """Aligned byte buffers lent and given back (see the module doc); `limit` in bytes."""

    def __init__(self, limit: int, unit: int = 0):
        self.limit = max(0, int(limit))
        self.unit = _capacity(int(unit)) if unit and unit > 0 else 0  # (see the module doc)
        self._free: list[np.ndarray] = []  # uint8, aligned, each its whole capacity
        self._held = 0  # bytes of every buffer made and not dropped: lent or free
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0

    def _take(self, nbytes: int) -> np.ndarray:
        """A buffer for `nbytes`: a free one (the smallest that fits; of equal ones the one given
        back last, whose lines the CPU's caches most likely still hold: a restore's scratch
        pieces, read into and copied out of at once, took the one given back first, the coldest,
        before the fourteenth stop), else a fresh one."""
        with self._lock:
            unit = self.unit if self.unit and nbytes <= self.unit else 0
            if unit:
                fits = [i for i, b in enumerate(self._free) if len(b) == unit]
            else:
                fits = [i for i, b in enumerate(self._free) if nbytes <= len(b) <= 2 * _capacity(nbytes)]
            if fits:  # the smallest that fits; of equal ones the last given back (`_take`'s doc)
                self.reuses += 1
                return self._free.pop(min(fits, key=lambda i: (len(self._free[i]), -i)))
            need = unit or _capacity(nbytes)
            self._free.sort(key=len)
            while self._free and self._held + need > self.limit:
                self._held -= len(self._free.pop())  # the largest free one first
            self._held += need
            self.allocations += 1
        return aligned_empty((need,), np.uint8)

    def _give(self, raw: np.ndarray) -> None:
        with self._lock:
            if self._held <= self.limit:
                self._free.append(raw)
            else:  # lent beyond the limit (a tile larger than the budget): not kept
                self._held -= len(raw)

    @contextmanager
    def lend(self, shape: tuple[int, ...], dtype) -> Iterator[np.ndarray]:
        """An uninitialised C-contiguous aligned array of `shape` and `dtype`, given back to the
        pool when the block ends: nothing may keep a view of it after that."""
        out, give = self.borrow(shape, dtype)
        try:
            yield out
        finally:
            give()

    def borrow(self, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, Callable[[], None]]:
        """As `lend`, for a buffer given back elsewhere than where it was taken (a restore's
        chunk kept for the pieces other threads cut from it later, `store.checked`): the array
        and the callable that gives it back (a second call does nothing)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        raw = [self._take(nbytes)]

        def give() -> None:
            if raw:
                self._give(raw.pop())

        return raw[0][:nbytes].view(dtype).reshape(shape), give

    def trim(self) -> None:
        """Drop the free buffers not of `unit` size (every free one without a `unit`)."""
        with self._lock:
            keep = [b for b in self._free if self.unit and len(b) == self.unit]
            self._held -= sum(len(b) for b in self._free) - sum(len(b) for b in keep)
            self._free = keep

    def clear(self) -> None:
        """Drop every free buffer (the save is over); lent ones are dropped when given back."""
        with self._lock:
            self._held -= sum(len(b) for b in self._free)
            self._free = []
