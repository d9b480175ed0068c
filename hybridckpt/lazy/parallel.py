"""Parallel byte-range IO: one shared pool of reader threads, one of writer threads, and their size knob.

Reads are `pread`s straight into preallocated numpy buffers (`LazyTensor.read_into`); `preadv`,
numpy copies, casts and the checksum all release the GIL on large arrays, so a few threads keep
the disk busy while other threads convert, transfer to devices and write.

Knob: the environment variable `HYBRIDCKPT_IO_THREADS`, or `set_io_threads(n)` (the CLI's
`--io-threads`). Default: `min(16, max(4, 2 * cpus))`: enough requests in flight to fill an NVMe
queue or a network filesystem, few enough not to thrash a 2-core machine. A streaming save's
chunk writes run in a pool of their own, two threads more than the readers (`write_pool`).

`read_box_parallel` splits one large box along its first splittable axis into pieces of at least
`MIN_PIECE_BYTES` read by the pool into one output buffer. `Prefetcher` reads the next tensors
of a known order ahead of a consumer (the safetensors writer) within a byte window.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from hybridckpt.errors import ConfigError
from hybridckpt.io import timing
from hybridckpt.io.direct_io import aligned_empty
from hybridckpt.io.page_advice import no_huge_pages
from hybridckpt.lazy import Box, LazyTensor, box_shape, full_box

ENV = "HYBRIDCKPT_IO_THREADS"
MIN_PIECE_BYTES = 8 << 20  # bytes: smaller pieces are read in one call

_lock = threading.Lock()
_override: int | None = None
_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}  # thread name prefix -> (size, pool)
_local = threading.local()
_END = object()
T = TypeVar("T")
R = TypeVar("R")


@functools.cache
def default_io_threads() -> int:
    """`min(16, max(4, 2 * cpus))`, the CPUs counted once (`os.cpu_count` reads a file of /sys:
    it was asked at every box a restore read)."""
    return min(16, max(4, 2 * (os.cpu_count() or 1)))


def io_threads() -> int:
    """The reader thread count: `set_io_threads`, else `$HYBRIDCKPT_IO_THREADS`, else the default."""
    if _override is not None:
        return _override
    text = os.environ.get(ENV, "").strip()
    if not text:
        return default_io_threads()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"${ENV}={text!r}: expected a positive integer (reader threads)")
    return int(text)


def set_io_threads(n: int | None) -> None:
    """Set the reader thread count for this process (None: back to the environment / default)."""
    global _override
    if n is not None and int(n) < 1:
        raise ConfigError(f"--io-threads must be >= 1, got {n}")
    _override = None if n is None else int(n)


def _mark_worker() -> None:
    _local.worker = True


def in_worker() -> bool:
    """True inside a pool thread (nested parallel reads then run inline, never deadlock)."""
    return getattr(_local, "worker", False)


def _shared_pool(prefix: str, n: int) -> ThreadPoolExecutor:
    """The shared pool of `n` threads named `prefix`, (re)built when the thread count changed."""
    with _lock:
        size, got = _pools.get(prefix, (0, None))
        if got is None or size != n:
            old = got
            got = ThreadPoolExecutor(n, thread_name_prefix=prefix, initializer=_mark_worker)
            _pools[prefix] = (n, got)
            if old is not None:
                old.shutdown(wait=False)
        return got


def pool() -> ThreadPoolExecutor:
    """The shared reader pool (`io_threads`)."""
    return _shared_pool("hybridckpt-io", io_threads())


def write_threads() -> int:
    """The writer thread count of a streaming save (`write_pool`): the readers' (`io_threads`) and
    two more. A writer mostly waits for the disk (an O_DIRECT chunk write), so this is how many
    writes the disk has queued while the readers read the next tiles: 4.4 GiB imported with 4
    readers on the 2-core VM of docs/benchmarks.md, medians of 8 alternating, 2.71 s with 4
    writers and 2.58 s with 6, against 2.89 s when each reader wrote the tile it had read."""
    return io_threads() + 2


def write_pool() -> ThreadPoolExecutor:
    """The shared writer pool (`write_threads`)."""
    return _shared_pool("hybridckpt-chunk-write", write_threads())


def split_box(box: Box, itemsize: int, pieces: int, min_bytes: int = MIN_PIECE_BYTES) -> list[Box]:
    """At most `pieces` consecutive sub-boxes of `box` along its first axis longer than 1,
    each at least `min_bytes` (fewer pieces when the box is small)."""
    shape = box_shape(box)
    nbytes = math.prod(shape) * itemsize
    n = max(1, min(pieces, nbytes // max(1, min_bytes)))
    axis = next((i for i, s in enumerate(shape) if s > 1), None)
    if n <= 1 or axis is None:
        return [box]
    a, b = box[axis]
    n = min(n, b - a)
    edges = [a + (b - a) * k // n for k in range(n + 1)]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sub = list(box)
        sub[axis] = (lo, hi)
        out.append(tuple(sub))
    return out


def read_box_parallel(t: LazyTensor, box: Box | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """`t.read_box(box)` with large boxes read as pieces by the pool into one buffer: a fresh one
    is 4 KiB-aligned (`io.direct_io.aligned_empty`), so a cold file is read into it with O_DIRECT
    (`io.direct_read`) and `jax.device_put` on a CPU device takes it as the device's buffer
    without a copy (XLA's CPU client aliases host arrays aligned to 64 bytes; numpy's large
    `np.empty` arrays start 16 bytes into a page, so each was copied: a second copy of every
    restored array, 0.35 GB of a 1.1 GB restore's peak RSS, issue 42); and it is backed by 4 KiB
    pages, not the huge pages numpy asks for (`io.page_advice`), each faulted in by the read or
    copy that first writes it. (Faulting them all in first, by one `MADV_POPULATE_WRITE` a slab,
    was slower on the 2-core VM of docs/benchmarks.md, "Thirteenth stop": a 1.1 GB restore warm
    0.52 against 0.48 s, cold 0.87 against 0.75 s, medians of 6 alternating; and reading into
    fresh memory with 2 threads, 0.39 against 0.30 s.)"""
    box = full_box(t.shape) if box is None else box
    if out is None:
        out = aligned_empty(box_shape(box), t.dtype)
        no_huge_pages(out)  # (4 KiB pages: zeroed by the kernel while cached, `io.page_advice`)
    parts = [] if in_worker() else split_box(box, np.dtype(t.dtype).itemsize, io_threads())
    if len(parts) <= 1:
        with timing.stage("read"):
            t.read_into(box, out)
        return out
    origin = [a for a, _ in box]

    def piece(sub: Box) -> None:
        where = tuple(slice(s - o, e - o) for (s, e), o in zip(sub, origin, strict=True))
        with timing.stage("read"):
            t.read_into(sub, out[where])

    for f in [pool().submit(piece, sub) for sub in parts]:
        f.result()
    return out


def read_boxes(t: LazyTensor, boxes: Sequence[Box]) -> list[np.ndarray]:
    """Several boxes of `t`, read in parallel (inline inside a pool thread)."""
    if len(boxes) <= 1 or in_worker():
        return [read_box_parallel(t, b) for b in boxes]
    futures = [pool().submit(read_box_parallel, t, b) for b in boxes]
    return [f.result() for f in futures]


def imap_bounded(fn: Callable[[T], R], items: Sequence[T], window: int) -> Iterator[R]:
    """`fn` over `items` in the pool, results in order, at most `window` started but not yet
    consumed (so at most `window` results held); inline inside a pool thread."""
    if in_worker() or len(items) <= 1:
        yield from map(fn, items)
        return
    pending: deque[Future] = deque()
    it = iter(items)
    for x in it:
        pending.append(pool().submit(fn, x))
        if len(pending) >= max(1, window):
            break
    while pending:
        fut = pending.popleft()
        nxt = next(it, _END)
        if nxt is not _END:
            pending.append(pool().submit(fn, nxt))
        yield fut.result()


class Prefetcher:
    """Reads tensors of `order` ahead of their consumer, keeping at most `window_bytes` read
    but not yet consumed (at least one tensor). `tensors()` returns views whose `read_box` of
    the full box takes the prefetched array; anything else (another box, a tensor consumed out
    of order) reads directly, so the result never depends on the order guess."""

    def __init__(self, tensors: Mapping[str, LazyTensor], order: Sequence[str], window_bytes: int):
        self._src = dict(tensors)
        self._order = [n for n in order if n in self._src]
        self._window = max(0, int(window_bytes))
        self._futures: dict[str, Future] = {}
        self._taken: set[str] = set()
        self._next = 0
        self._held = 0
        self._lock = threading.Lock()

    def _fill(self) -> None:
        with self._lock:
            while self._next < len(self._order):
                name = self._order[self._next]
                t = self._src[name]
                if name in self._taken:
                    self._next += 1
                    continue
                if self._futures and self._held + t.nbytes > self._window:
                    break
                self._next += 1
                self._held += t.nbytes
                self._futures[name] = pool().submit(read_box_parallel, t)

    def take(self, name: str) -> np.ndarray:
        """The whole tensor `name`: the prefetched array when there is one."""
        with self._lock:
            self._taken.add(name)
            fut = self._futures.pop(name, None)
        self._fill()
        if fut is None:
            return read_box_parallel(self._src[name])
        try:
            return fut.result()
        finally:
            with self._lock:
                self._held -= self._src[name].nbytes
            self._fill()

    def tensors(self) -> dict[str, LazyTensor]:
        return {n: _Prefetched(self, n, t) for n, t in self._src.items()}


class _Prefetched(LazyTensor):
    """A tensor whose whole-box read comes from a `Prefetcher`."""

    def __init__(self, owner: Prefetcher, name: str, src: LazyTensor):
        self._owner, self._name, self._t = owner, name, src

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._t.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._t.dtype

    def read_box(self, box: Box) -> np.ndarray:
        if tuple(box) == full_box(self.shape):
            return self._owner.take(self._name)
        return self._t.read_box(box)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        self._t.read_into(box, out)
