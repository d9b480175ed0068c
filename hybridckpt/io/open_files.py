"""The files `io.byte_source` reads, their descriptors kept open, and the jobs' watch on them.

Every local file a `ByteSource` reads is opened once and its descriptor kept (`held`), with what
it was when opened (`opened`: one fstat), so a short read can name how the file changed
(`io.unchanged`). At most `keep_open()` descriptors are kept: half the process's soft
`RLIMIT_NOFILE`, the rest left to the process (its outputs, sockets, JAX), within
[`MIN_KEPT`, `MAX_KEPT`]. Past it, opening another file closes the least recently used ones no
read holds (`held` is the lease: a descriptor is never closed under a read). Before, every
file stayed open: a restore of a store of more chunk files than the soft limit (1024 on many
systems: a 1.1 GB store has 573, a 7B model with AdamW some 14,000) failed with "Too many open
files". A file closed this way and read again is opened again, as a first open. `watch()` (held by every job that writes,
`writers.destination`) records each file as the job first reads it and checks them all after the
last read, before the output is committed: one fstat a file at each end, nothing per read; an
object of a bucket (`io.remote`) is recorded as listed and checked by one HEAD
(`note_remote`). A path replaced since its descriptor was cached (a folder converted again
after it was rewritten, in the same process) is reopened at a watched job's first read of it.
Split out of `io.byte_source` (issue 42: that module was at its 500-line limit).
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from hybridckpt.errors import FormatError
from hybridckpt.io.regular_file import open_regular_stat
from hybridckpt.io.remote import ranged
from hybridckpt.io.unchanged import Seen, check_fd

MIN_KEPT, MAX_KEPT = 16, 4096  # descriptors kept open (`keep_open`): whatever the process's limit

_lock = threading.Lock()
_fds: OrderedDict[str, int] = OrderedDict()  # least recently read first
_leases: dict[str, int] = {}  # reads holding each path's descriptor now (`held`): never closed under them
_kept: list[int] = []  # `keep_open()`, computed once
_opened: dict[str, Seen] = {}  # each cached file as it was when opened (a short read names the change)
_retired: list[int] = []  # fds of files replaced since they were opened (closed by close_all)
_watches: list[dict[str, Seen]] = []  # per `watch()`: each file as that job first read it


def keep_open() -> int:
    """The most descriptors kept open: half the process's soft `RLIMIT_NOFILE` (no limit:
    `MAX_KEPT`), within [`MIN_KEPT`, `MAX_KEPT`]."""
    if not _kept:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        half = MAX_KEPT if soft == resource.RLIM_INFINITY else soft // 2
        _kept.append(max(MIN_KEPT, min(MAX_KEPT, half)))
    return _kept[0]


@contextlib.contextmanager
def held(path: str) -> Iterator[int]:
    """`path`'s descriptor for the reads inside the block, which it is not closed under (opened
    now on its first read: a regular file only; the file recorded by every open `watch()` that
    has not seen it yet). A first open runs outside the lock (reader threads opening their files
    at once no longer wait on each other's `open` and `fstat`: 4% of a restore's reader
    samples); where two threads opened the same path, the first one kept is kept and the other
    closed. Opening a file past `keep_open()` closes the least recently read ones no block
    holds."""
    fd = _lease(path)
    try:
        yield fd
    finally:
        with _lock:
            n = _leases.pop(path, 0)  # (0: `close_all` ran meanwhile)
            if n > 1:
                _leases[path] = n - 1


def _lease(path: str) -> int:
    with _lock:
        got = _fds.get(path)
        if got is not None:
            _fds.move_to_end(path)
            for seen in _watches:
                if path not in seen:
                    got = _first_read_in_job(path, got, seen)
            _leases[path] = _leases.get(path, 0) + 1
            return got
    mine, st = open_regular_stat(path)  # a regular file: never a FIFO (would block) or a device
    with _lock:
        if path not in _fds:
            _close_idle(keep_open() - 1)
            _cache(path, mine, st)
            for seen in _watches:
                seen.setdefault(path, _opened[path])
            _leases[path] = _leases.get(path, 0) + 1
            return mine
    os.close(mine)  # another thread kept the path first: its descriptor is the one read
    return _lease(path)


def _close_idle(room: int) -> None:
    """Close the least recently read descriptors no read holds until at most `room` are kept
    (call under `_lock`). A closed file's record goes too: read again, it is opened as new."""
    if len(_fds) <= room:
        return
    for path in [p for p in _fds if p not in _leases][: len(_fds) - room]:
        os.close(_fds.pop(path))
        _opened.pop(path, None)


def _cache(path: str, fd: int, st: os.stat_result) -> int:
    """Cache `fd` as `path`'s descriptor, with what the file was at open (call under `_lock`)."""
    _fds[path] = fd
    _opened[path] = Seen.of(st)
    return fd


def _open(path: str) -> int:
    """Open `path`, cache its fd and what it is (one fstat; call under `_lock`)."""
    return _cache(path, *open_regular_stat(path))  # a regular file: never a FIFO (would block) or a device


def _first_read_in_job(path: str, fd: int, seen: dict[str, Seen]) -> int:
    """A watched job's first read of `path` (call under `_lock`): record what the file is now.
    A cached fd whose path was replaced since (a folder converted again after it was rewritten,
    in the same process) is reopened: the job reads the file the path names."""
    now = Seen.of(os.fstat(fd))
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and (st.st_dev, st.st_ino) != (now.dev, now.ino):
        _retired.append(fd)  # not closed: another thread may still read it
        fd = _open(path)
        now = _opened[path]
    seen[path] = now
    return fd


def _check_closed(path: str, seen: Seen) -> None:
    """`check_fd` for a file whose descriptor was closed since its first read (`keep_open`, or
    `close_all`): the file the path names now, against what was read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FormatError(f"{path} changed while it was read: {e.strerror or e}") from e  # (as `check_fd` says it)
    try:
        check_fd(path, fd, seen)
    finally:
        os.close(fd)


def opened(path: str) -> Seen | None:
    """What `path`'s cached descriptor was when opened (None: not open)."""
    return _opened.get(path)


def note_remote(path: str, obj: ranged.RemoteObject) -> None:
    """Record an object of a bucket read as `path` in every open `watch()` that has not seen it
    (checked unchanged by one HEAD before a watching job commits)."""
    if _watches:
        with _lock:
            for seen in _watches:
                seen.setdefault(path, obj)


def close_all() -> None:
    """Close every cached file descriptor (files may be replaced or deleted afterwards)."""
    with _lock:
        for fd in [*_fds.values(), *_retired]:
            os.close(fd)
        _fds.clear()
        _leases.clear()
        _opened.clear()
        _retired.clear()


@contextlib.contextmanager
def watch() -> Iterator[Watch]:
    """Inside the block, every file read is recorded as it is at its first read, and `check()`
    (after the last read) raises FormatError if any of them changed since (`io.unchanged`).
    Held by the jobs that write (also as a decorator, `@watch()`); `check_watches` is called
    by `writers.destination.Destination.commit` before the output is put in place."""
    seen: dict[str, Seen] = {}
    with _lock:
        _watches.append(seen)
    try:
        yield Watch(seen)
    finally:
        with _lock:
            del _watches[next(i for i, w in enumerate(_watches) if w is seen)]
            last = not _watches
        if last:  # no job reading: the ranges fetched from buckets are not kept past it
            ranged.forget()


def check_watches() -> None:
    """`Watch.check` of every `watch()` block open in this process (none: nothing to check)."""
    for seen in list(_watches):
        Watch(seen).check()


@dataclass(frozen=True)
class Watch:
    """The files a `watch()` block read, as they were at their first read."""

    seen: dict[str, Seen | ranged.RemoteObject]  # a local file as fstat saw it; an object as listed

    def check(self) -> None:
        """Raise FormatError naming the first file read in the block that changed since its first
        read (size, mtime, or the path now another file): one fstat and one stat a file."""
        with _lock:
            items = [(path, seen, _fds.get(path)) for path, seen in self.seen.items()]
            for path, seen, fd in sorted(items, key=lambda x: x[0]):
                if isinstance(seen, Seen):
                    check_fd(path, fd, seen) if fd is not None else _check_closed(path, seen)
        for _, seen, _ in sorted(items, key=lambda x: x[0]):
            if isinstance(seen, ranged.RemoteObject):  # an object of a bucket: one HEAD, outside the lock
                ranged.check_unchanged(seen)

