"""Byte-range reads from files, with a read counter.

Every byte hybridckpt reads from a checkpoint goes through `ByteSource.read_into`: one `pread`
per contiguous run, straight into a caller's preallocated buffer. `count_reads()` records how many
bytes each file gave, so tests can prove a device's read touched only the bytes of its box.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator
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


@dataclass(frozen=True)
class ByteSource:
    """A file read by byte ranges. `path` is absolute or relative to the working directory."""

    path: str

    def size(self) -> int:
        """File size in bytes."""
        return os.fstat(_fd(self.path)).st_size

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes at `[offset, offset + len(buffer))` of the file."""
        want = len(buffer)
        if want == 0:
            return
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
        if _counters:
            with _lock:
                for c in _counters:
                    c[self.path] += want
                    c[(self.path, "calls")] += 1

    def read(self, offset: int, nbytes: int) -> bytes:
        """The bytes at `[offset, offset + nbytes)`."""
        buf = bytearray(nbytes)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)
