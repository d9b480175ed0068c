"""Byte-range reads from files, with a read counter.

Every byte hybridckpt reads from a checkpoint goes through a `ByteSource`: `read_into`, one
`pread` per contiguous run straight into a caller's preallocated buffer; `read_runs`, many runs
packed into one buffer, batched into few `preadv` calls (`run_batches`: the rule on gap bytes
against calls); `read_span`, one pread of
a range holding a box of many short runs close together, which its consumer copies (strided,
transposed or cast) out of that buffer; or `copy_to`, which copies a byte range into another file inside
the kernel (`copy_file_range`: no user-space buffer, for exports that only rearrange stored
bytes). `count_reads()` records how many bytes each file gave (and the calls, the runs they fetched and the
gap bytes read between runs), so tests can prove a device's read
touched only the bytes of its box. A large `read_into`/`read_scatter`/`read_span` of a range the
page cache does not hold goes from the device straight into the buffers with O_DIRECT
(`io.direct_read`: how it decides, cold or warm), counted under `(path, "direct")` besides.

`planning()` makes this thread's data reads dry: each read is counted exactly as it would be
(bytes, calls, gaps) but no byte is read (the buffer is left as it was), so running the import's
own read path under it is its read plan (`jobs.plan_report`); `real_reads()` lifts it for the
metadata a lazy tensor parses on first use (a DCP chunk's `torch.save` header), read for real.
A planned read is counted only by this thread's counters (`count_reads(this_thread=True)`), never
by the every-thread counters that measure what an import really read.

A file that changes while it is read is an error, never zeros or a mix of two versions
(`io.unchanged`): a read that ends before the bytes asked for is a FormatError (naming the change
when the file's size is no longer the one it had when opened), and `watch()` (`io.open_files`,
where each file's descriptor is cached) records each file as a writing job first reads it and
checks them all after the last read, before the output is committed.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hybridckpt.errors import FormatError
from hybridckpt.io import direct_read, read_batches, timing
from hybridckpt.io.direct_io import aligned_empty
from hybridckpt.io.open_files import Watch, check_watches, close_all, note_remote, opened, watch  # noqa: F401
from hybridckpt.io.open_files import held as _held
from hybridckpt.io.read_batches import run_batches
from hybridckpt.io.remote import ranged
from hybridckpt.io.remote.view import remote_object
from hybridckpt.io.unchanged import Seen, changed_error

_lock = threading.Lock()  # the counters
_counters: list[Counter] = []
_thread = threading.local()  # .dry: this thread's reads are planned, not done (`planning`)


@contextlib.contextmanager
def count_reads(this_thread: bool = False, planned_too: bool = True) -> Iterator[Counter]:
    """Count bytes read per file path (and `(path, "calls")`, `(path, "gap")`, `(path, "direct")`:
    those read with O_DIRECT) inside the block:
    every thread's reads, or with `this_thread` only this thread's (a dry read planned while
    reader threads run, `store.stream.box_tiles`), and then with `planned_too=False` only the
    reads really done (the headers a planned read parses on first use)."""
    counter: Counter = Counter()
    held = _thread.__dict__.setdefault("counters", []) if this_thread else _counters
    entry = (counter, planned_too) if this_thread else counter
    with _lock:
        held.append(entry)
    try:
        yield counter
    finally:
        with _lock:  # by identity: two counters that counted the same are equal
            del held[next(i for i, e in enumerate(held) if e is entry)]


def _all_counters() -> list[Counter]:
    """The counters a read of this thread adds to (call under `_lock`): a real read to every
    thread's and this thread's own; a planned one only to this thread's that count planned
    reads (a plan probed while an import runs is not a read of that import)."""
    mine = getattr(_thread, "counters", None) or []
    if planned():
        return [c for c, planned_too in mine if planned_too]
    return _counters + [c for c, _ in mine] if mine else _counters


@contextlib.contextmanager
def planning(dry: bool = True) -> Iterator[None]:
    """Inside the block, this thread's reads are counted but not done (`dry`), or done again
    (`dry=False`, `real_reads`); the previous mode comes back after it."""
    before = getattr(_thread, "dry", False)
    _thread.dry = dry
    try:
        yield
    finally:
        _thread.dry = before


def real_reads() -> contextlib.AbstractContextManager[None]:
    """Reads done for real inside the block, even under `planning` (metadata parsed on first use)."""
    return planning(False)


def planned() -> bool:
    """Whether this thread's reads are planned, not done (`planning`): their bytes are not the
    file's, so a check of them (a chunk's CRC-32) has nothing to compare."""
    return getattr(_thread, "dry", False)


REMOTE_COPY_BYTES = 128 << 20  # bytes per step of a copy out of object storage (parts in parallel)
SCATTER_VIEWS = 1024  # views per preadv of `read_scatter` (Linux's IOV_MAX)
COPY_BUFFER_BYTES = 8 << 20  # bytes per pread/pwrite step where the kernel cannot copy
_HAS_COPY_FILE_RANGE = hasattr(os, "copy_file_range")
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def _count(path: str, nbytes: int, runs: int = 1) -> None:
    """Count one call that read `nbytes` useful bytes making `runs` contiguous pieces."""
    if timing.enabled() and not planned():  # a profiled job: the bytes go to this thread's stage
        timing.add_bytes(nbytes)
    if _counters or getattr(_thread, "counters", None):
        with _lock:
            for c in _all_counters():
                c[path] += nbytes
                c[(path, "calls")] += 1
                c[(path, "runs")] += runs


def _count_direct(path: str, nbytes: int) -> None:
    """Count `nbytes` of a read as read with O_DIRECT (`io.direct_read`), under `(path, "direct")`."""
    if _counters or getattr(_thread, "counters", None):
        with _lock:
            for c in _all_counters():
                c[(path, "direct")] += nbytes


def _count_requests(req: ranged.Requests) -> None:
    """Add a remote read's GETs and bytes requested to the counters, under `(host, "requests")`
    and `(host, "requested")` (planned reads too: they are what the import will ask for)."""
    if (req.count or req.nbytes) and (_counters or getattr(_thread, "counters", None)):
        with _lock:
            for c in _all_counters():
                c[(req.host, "requests")] += req.count
                c[(req.host, "requested")] += req.nbytes


def _remote_into(path: str, obj: ranged.RemoteObject, ranges: list[tuple[int, int]], buffer: memoryview,
                 at: list[int]) -> None:
    """Fill `buffer` with the object's `ranges` (the i-th at buffer offset `at[i]`) by ranged
    GETs (`io.remote.ranged`: coalesced, parallel, retried), or only count them when planned."""
    if planned():
        _count_requests(ranged.planned_cost(obj, ranges))
        return
    note_remote(path, obj)  # (checked unchanged by one HEAD before a watching job commits)
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    starts = [ranges[i][0] for i in order]

    def sink(start: int, data: memoryview) -> None:
        end = start + len(data)
        j = bisect.bisect_left(starts, start)
        while j > 0 and ranges[order[j - 1]][1] > start:  # a range begun in the piece before
            j -= 1
        while j < len(order) and starts[j] < end:
            i = order[j]
            a, b = ranges[i]
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                buffer[at[i] + lo - a: at[i] + hi - a] = data[lo - start: hi - start]
            j += 1

    _count_requests(ranged.read_ranges(obj, ranges, sink))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


@dataclass(frozen=True)
class ByteSource:
    """A file read by byte ranges. `path` is absolute or relative to the working directory."""

    path: str

    def size(self) -> int:
        """File size in bytes."""
        obj = remote_object(self.path)
        if obj is not None:
            return obj.size
        with _held(self.path) as fd:
            return os.fstat(fd).st_size

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes at `[offset, offset + len(buffer))` of the file."""
        if len(buffer):
            self._pread_into(offset, buffer)
            _count(self.path, len(buffer))

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None:
        """Fill `views` in order with the bytes from `offset`: one run of the file straight into
        the rows of a strided buffer (a piece of a chunk into its shard), by `preadv`s of at most
        `SCATTER_VIEWS` views: no packed buffer, no copy."""
        if (total := sum(len(v) for v in views)) == 0:
            return
        obj = remote_object(self.path)
        if obj is not None or planned():  # the run whole by ranged GETs, then its rows (planned: counted)
            if obj is not None and planned():
                _count_requests(ranged.planned_cost(obj, [(offset, offset + total)]))
            elif obj is not None:
                whole, at = memoryview(bytearray(total)), 0
                self._pread_into(offset, whole)
                for v in views:
                    v[:] = whole[at: at + len(v)]
                    at += len(v)
            _count(self.path, total)
            return
        if offset < 0:  # a corrupt offset field: pread would fail with EINVAL
            raise FormatError(f"{self.path}: read at byte {offset}, before the start of the file")
        at = offset
        with _held(self.path) as fd:
            if direct_read.read(fd, offset, views, total):  # a cold range: from the device, no page cache
                _count_direct(self.path, total)
                views = []
            for i in range(0, len(views), SCATTER_VIEWS):
                batch = views[i: i + SCATTER_VIEWS]
                want = sum(len(v) for v in batch)
                try:
                    got = os.preadv(fd, batch, at)
                except OSError as e:
                    raise FormatError(f"{self.path}: cannot read bytes [{at}, {at + want}): {e.strerror}") from e
                if got != want:  # a short read: view by view (which finishes it or names the truncation)
                    for v in batch:
                        self._pread_into(at, v)
                        at += len(v)
                else:
                    at += want
        _count(self.path, total)

    def read_runs(self, offsets: np.ndarray, run_bytes: int, buffer: memoryview, stride: int | None = None) -> None:
        """Fill `buffer` (`len(offsets) * run_bytes` bytes) with the runs of `run_bytes` bytes at
        the file's byte `offsets`, packed in their order (`stride`: run k at byte `k * stride` of
        `buffer` instead, the rows of a padded buffer: `lazy.element_copy.transposed_rows`). A box of many runs far apart (a target
        mesh that cuts a source chunk across its rows: a strip of every row) is millions of them,
        so they are batched (`run_batches`): consecutive runs at most `GAP_PER_CALL_BYTES` apart
        are one `preadv` of their span, each run straight into its place in `buffer` and each gap
        into one shared scratch buffer (at most that many bytes: memory stays bounded); runs
        further apart are a pread each. Counted once for all: the runs' bytes, the calls, the
        runs (`(path, "runs")`) and the gap bytes read (`(path, "gap")`). Under `planning` none
        is read and the count is the same."""
        n = len(offsets)
        if n == 0 or run_bytes == 0:
            return
        step = run_bytes if stride is None else int(stride)
        if step < run_bytes or len(buffer) < (n - 1) * step + run_bytes or (stride is None and len(buffer) != n * run_bytes):
            raise ValueError(f"read_runs: a buffer of {len(buffer)} bytes for {n} runs of {run_bytes}, {step} apart")
        starts, gaps = run_batches(offsets, run_bytes)
        obj = remote_object(self.path)
        if obj is not None:  # a data file in object storage: ranged GETs (coalesced there)
            runs = offsets.tolist()
            _remote_into(self.path, obj, [(o, o + run_bytes) for o in runs], buffer,
                         list(range(0, n * step, step)))
        elif not planned():
            if int(np.min(offsets)) < 0:  # a corrupt offset field: pread would fail with EINVAL
                raise FormatError(f"{self.path}: read at byte {int(np.min(offsets))}, before the start of the file")
            self._read_batches(offsets.tolist(), run_bytes, buffer, starts.tolist() + [n], step)
            if timing.enabled():
                timing.add_bytes(n * run_bytes)
        if _counters or getattr(_thread, "counters", None):
            with _lock:
                for c in _all_counters():
                    c[self.path] += n * run_bytes
                    c[(self.path, "calls")] += len(starts)
                    c[(self.path, "runs")] += n
                    if gaps:
                        c[(self.path, "gap")] += gaps

    def _read_batches(self, offsets: list[int], run_bytes: int, buffer: memoryview, bounds: list[int],
                      step: int) -> None:
        """The reads of `read_runs`: runs `bounds[i]:bounds[i + 1]` are one preadv (`run_batches`),
        its buffers the runs' places in `buffer` (`step` bytes apart) interleaved with views of one
        scratch buffer the length of each gap (one view per distinct length: a cut's gaps are all alike)."""
        with _held(self.path) as fd:
            scratch = memoryview(bytearray(read_batches.GAP_PER_CALL_BYTES))  # every gap of every batch lands here
            gap_views: dict[int, memoryview] = {}
            for i, j in zip(bounds, bounds[1:], strict=False):
                first, last = offsets[i], offsets[j - 1]
                iov: list = [None] * (2 * (j - i) - 1)
                iov[0::2] = [buffer[a : a + run_bytes] for a in range(i * step, j * step, step)]
                gaps = [b - a - run_bytes for a, b in zip(offsets[i : j - 1], offsets[i + 1 : j], strict=True)]
                for g in set(gaps) - gap_views.keys():
                    gap_views[g] = scratch[:g]
                iov[1::2] = [gap_views[g] for g in gaps]
                want = last + run_bytes - first
                try:
                    got = os.preadv(fd, iov, first)
                except OSError as e:
                    raise FormatError(
                        f"{self.path}: cannot read bytes [{first}, {first + want}): {e.strerror}"
                    ) from e
                if got != want:  # a short read: the general loop, run by run, finishes it or names the truncation
                    for k in range(i, j):
                        self._pread_into(offsets[k], buffer[k * step : k * step + run_bytes])

    def _pread_into(self, offset: int, buffer: memoryview) -> None:
        want = len(buffer)
        obj = remote_object(self.path)
        if obj is not None:  # a data file in object storage: ranged GETs (or their plan)
            _remote_into(self.path, obj, [(offset, offset + want)], buffer, [0])
            return
        if planned():  # planned: counted by the caller, not read
            return
        if offset < 0:  # a corrupt offset field: pread would fail with EINVAL
            raise FormatError(f"{self.path}: read at byte {offset}, before the start of the file")
        with _held(self.path) as fd:
            done = direct_read.read(fd, offset, [buffer])  # a cold range: from the device, no page cache
            if done:
                _count_direct(self.path, done)
            while done < want:
                try:
                    got = os.preadv(fd, [buffer[done:]], offset + done)
                except OSError as e:
                    raise FormatError(
                        f"{self.path}: cannot read bytes [{offset}, {offset + want}): {e.strerror}"
                    ) from e
                if got == 0:
                    self._changed(fd)
                    raise FormatError(
                        f"{self.path}: truncated: wanted bytes [{offset}, {offset + want}) "
                        f"but the file ends at {offset + done}"
                    )
                done += got

    def _changed(self, fd: int) -> None:
        """At a short read: FormatError saying how the file changed, if it did since opened."""
        before = opened(self.path)
        if before is not None:
            err = changed_error(self.path, before, Seen.of(os.fstat(fd)))
            if err is not None:
                raise err

    def _check_holds(self, fd: int, offset: int, nbytes: int) -> None:
        """FormatError unless the open file `fd` holds bytes `[offset, offset + nbytes)`."""
        if offset < 0:
            raise FormatError(f"{self.path}: read at byte {offset}, before the start of the file")
        size = os.fstat(fd).st_size
        if offset + nbytes > size:
            self._changed(fd)
            raise FormatError(
                f"{self.path}: truncated: wanted bytes [{offset}, {offset + nbytes}) but the file "
                f"ends at {size}"
            )

    def read_span(self, offset: int, nbytes: int, run_starts: Sequence[int], run_bytes: int) -> np.ndarray:
        """The bytes `[offset, offset + nbytes)` as a fresh uint8 array, read by pread (the caller
        bounds `nbytes`), for a box of many short runs less than a page apart (a tp shard of a
        row-parallel weight: half of every row): its consumer then makes one strided,
        transposing or casting copy out of this buffer instead of one pread a run. The runs
        (`run_starts`, byte offsets from `offset`, of `run_bytes` each) are what the counter adds
        to the file's bytes; the gaps, which lie in the pages the runs touch anyway, go to
        `(path, "gap")`. The file is never mapped: a file that another process truncates while it
        is read is a FormatError ("truncated"), never a SIGBUS."""
        buf = aligned_empty((nbytes,), np.uint8)  # (a cold span: read into with O_DIRECT, `io.direct_read`)
        if nbytes:
            self._pread_into(offset, memoryview(buf))
            useful = len(run_starts) * run_bytes
            _count(self.path, useful, len(run_starts))
            if nbytes > useful and (_counters or getattr(_thread, "counters", None)):
                with _lock:
                    for c in _all_counters():
                        c[(self.path, "gap")] += nbytes - useful
        return buf

    def copy_to(self, offset: int, nbytes: int, out_fd: int, out_offset: int) -> None:
        """Copy bytes `[offset, offset + nbytes)` of the file to byte `out_offset` of the open file
        `out_fd`: `copy_file_range` where the kernel has it, else `pread` + `pwrite` through a
        bounded buffer. Errors name this file; errors writing `out_fd` stay OSError. A file in
        object storage is read by ranged GETs, `REMOTE_COPY_BYTES` at a time."""
        if remote_object(self.path) is not None:
            self._copy_remote(offset, nbytes, out_fd, out_offset)
            return
        done = 0
        with _held(self.path) as fd:
            self._check_holds(fd, offset, nbytes)
            while done < nbytes and _HAS_COPY_FILE_RANGE:
                try:
                    got = os.copy_file_range(fd, out_fd, nbytes - done, offset + done, out_offset + done)
                except OSError as e:
                    if e.errno in _NO_KERNEL_COPY:
                        break  # another filesystem or an old kernel: copy through user space
                    raise
                if got == 0:
                    break  # the end of the file, or a filesystem that reports none: pread decides
                done += got
        while done < nbytes:
            n = min(COPY_BUFFER_BYTES, nbytes - done)
            buf = memoryview(bytearray(n))
            self._pread_into(offset + done, buf)
            _pwrite_all(out_fd, buf, out_offset + done)
            done += n
        if nbytes:
            _count(self.path, nbytes)

    def _copy_remote(self, offset: int, nbytes: int, out_fd: int, out_offset: int) -> None:
        done = 0
        while done < nbytes:
            n = min(REMOTE_COPY_BYTES, nbytes - done)
            buf = memoryview(bytearray(n))
            self._pread_into(offset + done, buf)
            if not planned():
                _pwrite_all(out_fd, buf, out_offset + done)
            done += n
        if nbytes:
            _count(self.path, nbytes)

    def read(self, offset: int, nbytes: int) -> bytes:
        """The bytes at `[offset, offset + nbytes)`."""
        buf = bytearray(nbytes)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)
