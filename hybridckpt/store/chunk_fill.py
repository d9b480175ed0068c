"""A restore's arrays filled chunk by chunk: each stored chunk read once, checked whole against its
CRC-32, and copied into every shard of this process it meets (issue 42).

`store.read_item.read_items` places the arrays of the items restored on their shardings. An array that is a raw
chunk grid of our store (`containers.orbax.reader.ChunkGrid`: a file a chunk, the chunks the grid
of its CRC table) restored in its stored dtype is filled here, not box by box through
`CheckedArray.read_into`:

- plan (`ArrayFill.plan`, no IO): a 4 KiB-aligned buffer of small pages
  (`io.page_advice`) for each distinct box of this process's devices (`plan.box_holders`), and a
  `ChunkJob` for each stored chunk those boxes meet: the chunk's file and offset, its shape, and
  its parts, (slice of the chunk, view of a shard buffer) pairs;
- fill (`ChunkJob.run`, the reader pool's threads, `fill_arrays`; the next array planned by the
  worker that finds the jobs before it running low): the chunk read by one pread
  (O_DIRECT when its pages are not cached, `io.direct_read`) into a buffer the worker borrows
  from the restore's scratch pool, its CRC-32 taken by one call and compared
  (`CheckedArray.compare`), each part copied out; a chunk that is its one part, the whole of a
  C-contiguous view (a restore onto the mesh the store was written on), is read straight into
  that view and checked there;
- place (the calling thread, array after array in the order given, each once its last chunk
  has landed): one `jax.device_put` of its shard buffers onto their devices (a CPU device takes
  the buffer itself) and `jax.make_array_from_single_device_arrays`.

The workers take the jobs of every array in order from one queue, so none waits at an array's end
while another array has chunks left; an array's chunks in `grid_apart` order (last grid dim
slowest), so the chunks taken at once are in different rows of the shards, not on the same pages.
Box by box, a chunk the new mesh cuts in two (every chunk of a fsdp=2,tp=2 store restored onto
fsdp=4) was two reads, two CRC-32 calls joined by `checksum.crc32_combine`, two lent buffers and
about 65 us of Python a piece, taken by four reader threads in turn under the GIL; here it is one of
each a chunk (docs/benchmarks.md, "Eighteenth stop": 7% less wall on a 2.3 GB store, 3% on 4.7 GB).

What each process reads: the chunks its devices' boxes meet, each whole (its CRC-32 is the whole
chunk's), none of another process's alone. An array that is not such a grid (TensorStore decodes
it, a chunk stored padded at the edge or inline in an OCDBT index, a cast to another dtype, reads
unchecked, a read plan) or whose chunks that must be cut exceed `LENT_MAX` is not planned here
(`ArrayFill.plan` says False) and goes through `CheckedArray.read_into` as before.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from hybridckpt import checksum
from hybridckpt.io import timing
from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.io.byte_source import ByteSource, planned
from hybridckpt.io.direct_io import aligned_empty
from hybridckpt.io.page_advice import no_huge_pages
from hybridckpt.lazy import Box, box_shape, box_slices, parallel
from hybridckpt.plan import box_holders
from hybridckpt.store.checked import CheckedArray

LENT_MAX = 64 << 20  # bytes: a chunk that must be cut is read into a lent buffer of at most this


@dataclass(frozen=True, eq=False)
class ChunkJob:
    """One stored chunk of an array this process places: its grid position (C order), the file and
    byte offset of its C-order bytes, its shape (its box, clipped at the array's edge), and its
    parts, (slice of the chunk, view of a shard buffer) pairs."""

    fill: ArrayFill
    pos: int
    source: ByteSource
    offset: int  # bytes
    shape: tuple[int, ...]
    parts: tuple[tuple[tuple[slice, ...], np.ndarray], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.fill.array.dtype.itemsize

    @property
    def into_place(self) -> np.ndarray | None:
        """The view the chunk is read straight into: its one part when that is the whole chunk and
        C-contiguous; else None (read into a lent buffer, then copied)."""
        if len(self.parts) == 1:
            dst = self.parts[0][1]
            if dst.shape == self.shape and dst.flags.c_contiguous:
                return dst
        return None

    def run(self, lent: np.ndarray | None) -> None:
        """Read the chunk (into its place, else into `lent`: uint8, at least `nbytes`), compare its
        CRC-32 with the import's record (a CheckpointError naming the chunk), copy its parts."""
        t = self.fill.array
        dst = self.into_place
        target = dst.reshape(-1).view(np.uint8) if dst is not None else lent[: self.nbytes]
        with timing.stage("read"):
            self.source.read_into(self.offset, memoryview(target))
        with timing.stage("checksum", self.nbytes):
            crc = checksum.crc32_of(target)
        t.compare(self.pos, crc)
        if dst is None:
            data = target.view(t.dtype).reshape(self.shape)
            with timing.stage("cut"):
                for piece, out in self.parts:
                    np.copyto(out, data[piece])


def grid_apart(pos: int, grid: Sequence[int]) -> tuple[int, ...]:
    """The order an array's chunk jobs are taken in: chunk `pos` (its C-order position in a grid
    of `grid` chunks a dim) keyed by its grid index last dim first, so that the chunks the reader
    threads take at once are neighbours in the grid's first dims, not its last. Neighbours in the
    last dim are column ranges of the same rows (a fsdp=2,tp=2 store's [embed, ffn] chunks), whose
    parts the threads would copy into the same pages of the same shards at once; in different rows
    their pages are apart. No IO. (The restore of a 2.3 GB store onto fsdp=4: 6 of 6 pairs faster,
    0.731 against 0.743 s, 0.04 system CPU-s less; 4.7 GB: 1.39 against 1.45 s; cold 1.09 against
    1.16 s: docs/benchmarks.md, "Nineteenth stop".)"""
    index = []
    for n in reversed(grid):
        pos, i = divmod(pos, n) if n else (pos, 0)  # (a dim of 0 chunks: an empty array, no jobs)
        index.append(i)
    return tuple(index)


class ArrayFill:
    """One array placed by chunks: `array` (a `CheckedArray`) on `sharding`; after `plan`, its
    shard buffers by box, its jobs, and the jobs not yet done (`left`, kept by `fill_arrays`)."""

    def __init__(self, array: CheckedArray, sharding: jax.sharding.Sharding):
        self.array, self.sharding = array, sharding
        self.shape = tuple(array.shape)
        self.holders: dict[Box, list] = {}
        self.buffers: dict[Box, np.ndarray] = {}
        self.jobs: list[ChunkJob] = []
        self.left = 0
        self.planned = False  # (set by `plan`: the array is filled here)

    @staticmethod
    def eligible(array, dtype) -> bool:
        """Whether `array` read as `dtype` can be filled by chunks (see the module doc); no IO."""
        if not isinstance(array, CheckedArray) or np.dtype(dtype) != array.dtype or planned():
            return False
        grid = array.raw_grid()
        return grid is not None and getattr(grid, "chunk", None) == array.chunk

    def plan(self) -> bool:
        """Make the shard buffers and the chunk jobs (no IO); False (nothing kept) where a chunk
        has no file of its own bytes or must be cut from a buffer larger than `LENT_MAX`."""
        t, grid = self.array, self.array.raw_grid()
        holders = box_holders(self.shape, self.sharding)
        buffers: dict[Box, np.ndarray] = {}
        parts: dict[int, tuple[Box, list]] = {}
        for box in holders:
            out = buffers[box] = aligned_empty(box_shape(box), t.dtype)
            no_huge_pages(out)  # (4 KiB pages, faulted in by the copy or read that first writes them)
            for pos, cbox in t.chunk_boxes(box):
                sub = tuple((max(a, ca), min(b, cb)) for (a, b), (ca, cb) in zip(box, cbox, strict=True))
                parts.setdefault(pos, (cbox, []))[1].append((box_slices(sub, cbox), out[box_slices(sub, box)]))
        jobs = []
        for pos, (cbox, got) in parts.items():
            shape = box_shape(cbox)
            where = grid.chunk_file(pos, shape)
            if where is None:
                return False
            job = ChunkJob(self, pos, where[0], where[1], shape, tuple(got))
            if job.into_place is None and job.nbytes > LENT_MAX:
                return False
            jobs.append(job)
        jobs.sort(key=lambda job: grid_apart(job.pos, t.grid))
        self.holders, self.buffers, self.jobs, self.left = holders, buffers, jobs, len(jobs)
        self.planned = True
        return True

    def place(self) -> jax.Array:
        """The global array of the filled shard buffers (every job done), placed on their devices
        by one `device_put`; the buffers are the devices' now (on a CPU device, without a copy)."""
        bufs, devices = [], []
        for box, held_by in self.holders.items():
            for device in held_by:
                bufs.append(self.buffers[box])
                devices.append(device)
        with timing.stage("transfer", sum(b.nbytes for b in bufs)):
            shards = jax.device_put(bufs, devices) if bufs else []
            out = jax.make_array_from_single_device_arrays(self.shape, self.sharding, shards)
        self.buffers, self.jobs = {}, []
        return out


class _Queue:
    """The arrays to fill (`pending`, planned one at a time by the worker that finds the queue low:
    no array's planning holds up the reads of those before it), their chunk jobs in order
    (`items`), the first error any worker meets (then no job is given out), and each array's
    `left` count, all under one condition."""

    def __init__(self, fills: Sequence[ArrayFill], low: int):
        self.cv = threading.Condition()
        self.pending: deque[ArrayFill] = deque(fills)
        self.items: deque[ChunkJob] = deque()
        self.low = low  # jobs left at which the next array is planned
        self.planning = False
        self.decided: set[int] = set()  # id() of the fills planned, or found not to plan
        self.error: BaseException | None = None

    def take(self) -> ChunkJob | None:
        """The next job (planning the next array first where the queue is low), or None: no job
        left, or an error."""
        while True:
            with self.cv:
                if self.error is not None:
                    return None
                if self.pending and not self.planning and len(self.items) <= self.low:
                    fill, self.planning = self.pending.popleft(), True
                elif self.items:
                    return self.items.popleft()
                elif not self.pending and not self.planning:
                    return None
                else:
                    self.cv.wait()
                    continue
            try:
                with timing.stage("plan"):
                    planned = fill.plan()
            except BaseException as e:
                self.fail(e)
                return None
            with self.cv:
                self.planning = False
                if planned:
                    self.items.extend(fill.jobs)
                self.decided.add(id(fill))
                self.cv.notify_all()

    def done(self, job: ChunkJob) -> None:
        with self.cv:
            job.fill.left -= 1
            if not job.fill.left:
                self.cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = error
            self.items.clear()
            self.pending.clear()
            self.cv.notify_all()

    def wait(self, fill: ArrayFill) -> None:
        """Until `fill` is planned and its jobs all done, or found not to plan; the first error of
        any job or plan raised here."""
        with self.cv:
            while (id(fill) not in self.decided or fill.left) and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise self.error


def _work(queue: _Queue, scratch: AlignedPool) -> None:
    """A worker: jobs until none is left, into one buffer borrowed from `scratch` (grown when a
    chunk needs more, given back at the end)."""
    lent, give = None, None
    try:
        while (job := queue.take()) is not None:
            if job.into_place is None and (lent is None or lent.nbytes < job.nbytes):
                if give is not None:
                    give()
                lent, give = scratch.borrow((job.nbytes,), np.uint8)
            job.run(lent)
            queue.done(job)
    except BaseException as e:  # (raised by the thread that waits on the arrays)
        queue.fail(e)
    finally:
        if give is not None:
            give()


def fill_arrays(fills: Sequence[ArrayFill], scratch: AlignedPool) -> Iterator[tuple[ArrayFill, jax.Array]]:
    """(fill, its global array) for each of `fills` that plans (`ArrayFill.plan`), in order, each
    once its chunks have landed; planned and read by the reader pool's threads (`parallel.pool`,
    `io_threads()` of them; this thread alone where it is a pool thread) into buffers `scratch`
    lends, each array planned when the jobs before it run low. A fill that does not plan is left
    for the caller (`planned` False, not yielded)."""
    if not fills:
        return
    n = parallel.io_threads()
    queue = _Queue(fills, low=n)
    inline = parallel.in_worker()
    workers = [] if inline else [parallel.pool().submit(_work, queue, scratch) for _ in range(n)]
    try:
        if inline:
            _work(queue, scratch)
        for fill in fills:
            queue.wait(fill)
            if fill.planned:
                yield fill, fill.place()
    except BaseException as e:
        queue.fail(e)
        raise
    finally:
        for w in workers:
            w.result()  # (the workers' errors are the queue's, raised above: these only end)
