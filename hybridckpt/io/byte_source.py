"""Byte-range reads from files, with a read counter.

Every byte hybridckpt reads from a checkpoint goes through a `ByteSource`: `read_into`, one
`pread` per contiguous run straight into a caller's preallocated buffer; `mapped`, a range mapped
read-only for a box of many short runs, which its consumer copies (strided, transposed or cast)
straight out of the page cache; or `copy_to`, which copies a byte range into another file inside
the kernel (`copy_file_range`: no user-space buffer, for exports that only rearrange stored
bytes). `count_reads()` records how many bytes each file gave, so tests can prove a device's read
touched only the bytes of its box.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hybridckpt.errors import FormatError

_lock = threading.Lock()
_fds: dict[str, int] = {}
_counters: list[Counter] = []


def _fd(path: str) -> int:
    with _lock:
        fd = _fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise FormatError(f"{path}: cannot open: {e.strerror}") from e
            _fds[path] = fd
        return fd


def close_all() -> None:
    """Close every cached file descriptor (files may be replaced or deleted afterwards)."""
    with _lock:
        for fd in _fds.values():
            os.close(fd)
        _fds.clear()


@contextlib.contextmanager
def count_reads() -> Iterator[Counter]:
    """Count bytes read per file path (and `'<calls>'` per path with suffix) inside the block."""
    counter: Counter = Counter()
    with _lock:
        _counters.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _counters.remove(counter)


COPY_BUFFER_BYTES = 8 << 20  # bytes per pread/pwrite step where the kernel cannot copy
_HAS_COPY_FILE_RANGE = hasattr(os, "copy_file_range")
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def _count(path: str, nbytes: int) -> None:
    if _counters:
        with _lock:
            for c in _counters:
                c[path] += nbytes
                c[(path, "calls")] += 1


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
        return os.fstat(_fd(self.path)).st_size

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes at `[offset, offset + len(buffer))` of the file."""
        if len(buffer):
            self._pread_into(offset, buffer)
            _count(self.path, len(buffer))

    def _pread_into(self, offset: int, buffer: memoryview) -> None:
        want = len(buffer)
        if offset < 0:  # a corrupt offset field: pread would fail with EINVAL
            raise FormatError(f"{self.path}: read at byte {offset}, before the start of the file")
        fd = _fd(self.path)
        done = 0
        while done < want:
            try:
                got = os.preadv(fd, [buffer[done:]], offset + done)
            except OSError as e:
                raise FormatError(
                    f"{self.path}: cannot read bytes [{offset}, {offset + want}): {e.strerror}"
                ) from e
            if got == 0:
                raise FormatError(
                    f"{self.path}: truncated: wanted bytes [{offset}, {offset + want}) "
                    f"but the file ends at {offset + done}"
                )
            done += got

    def _fd_holding(self, offset: int, nbytes: int) -> int:
        """The open file, checked to hold bytes `[offset, offset + nbytes)` (else FormatError)."""
        if offset < 0:
            raise FormatError(f"{self.path}: read at byte {offset}, before the start of the file")
        fd = _fd(self.path)
        size = os.fstat(fd).st_size
        if offset + nbytes > size:
            raise FormatError(
                f"{self.path}: truncated: wanted bytes [{offset}, {offset + nbytes}) but the file "
                f"ends at {size}"
            )
        return fd

    @contextlib.contextmanager
    def mapped(
        self, offset: int, nbytes: int, run_starts: Sequence[int], run_bytes: int
    ) -> Iterator[tuple[mmap.mmap, int] | None]:
        """The bytes `[offset, offset + nbytes)` mapped read-only: yields `(map, at)`, the range
        starting at byte `at` of `map`, or None where the file cannot be mapped (the caller
        preads instead). A box of many short runs (a tp shard of a row-parallel weight: half
        of every row) is then copied straight out of the page cache by its consumer (one
        strided or transposing copy) instead of one pread a run; only the pages holding its
        bytes are touched. `run_starts` (byte offsets from `offset`) and `run_bytes`: the runs
        the caller copies out, counted as read (one call). The file is checked long enough first
        (a truncated file is a FormatError, not a SIGBUS); it must not shrink while mapped.
        Every view of the map must be dropped before the block ends (else the unmap waits for
        the garbage collector)."""
        fd = self._fd_holding(offset, nbytes)
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            m = mmap.mmap(fd, offset + nbytes - base, prot=mmap.PROT_READ, offset=base)
        except (OSError, ValueError):  # a filesystem without mmap (some FUSE mounts)
            yield None
            return
        try:
            yield m, offset - base
            _count(self.path, len(run_starts) * run_bytes)
        finally:
            try:
                m.close()
            except BufferError:  # a view still held (an exception's traceback): unmapped by GC
                pass

    def copy_to(self, offset: int, nbytes: int, out_fd: int, out_offset: int) -> None:
        """Copy bytes `[offset, offset + nbytes)` of the file to byte `out_offset` of the open file
        `out_fd`: `copy_file_range` where the kernel has it, else `pread` + `pwrite` through a
        bounded buffer. Errors name this file; errors writing `out_fd` stay OSError."""
        fd = self._fd_holding(offset, nbytes)
        done = 0
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

    def read(self, offset: int, nbytes: int) -> bytes:
        """The bytes at `[offset, offset + nbytes)`."""
        buf = bytearray(nbytes)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)
