"""A file as a read-only bytes-like object, read by `pread` in windows: what a walk over a file
that jumps (Paddle's pickle opcodes around large array payloads) reads instead of a mapping.

Why not mmap: a mapped file that another process truncates kills the reader with SIGBUS at the
next touch of a page past the new end, and Python cannot turn that signal into an error. A pread
that ends early is an error instead (`io.unchanged`: "X changed while it was read: size A -> B").

What it reads: indexing, slicing and `find` load a window at the position asked; the window
starts at MIN_WINDOW bytes and doubles while the walk goes on where the last window ended (a run
of small arrays read inline), back to MIN_WINDOW after a jump (a payload skipped). The fd is
advised POSIX_FADV_RANDOM so the kernel reads no more than the window either (an mmap fault or
a buffered read would read ahead into the payload that follows a header: 8 MiB a fault on some
disks, commit 689beb4). Reads: bytes and preads of the walk only; payloads are never read.
"""

from __future__ import annotations

import os

from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import ByteSource, real_reads
from hybridckpt.io.regular_file import open_regular_stat
from hybridckpt.io.remote.view import remote_object
from hybridckpt.io.unchanged import Seen, changed_error, check_fd

MIN_WINDOW = 4096  # bytes read after a jump: a header and what follows it in its page
MAX_WINDOW = 1 << 20  # bytes: the largest window a sequential walk grows to


class PreadView:
    """`path` opened read-only, indexed like `bytes` (`len`, `[i]`, `[a:b]`, `find`) by preads.
    Use as a context manager; `check_unchanged()` after the last read (see the module doc)."""

    def __init__(self, path: str):
        self.path = path
        self._buf, self._base, self._window = b"", 0, MIN_WINDOW
        obj = remote_object(path)
        if obj is not None:  # a placeholder of an object in a bucket: its windows are ranged GETs
            self._fd, self._remote = None, obj
            return
        self._remote = None
        self._fd, st = open_regular_stat(path)  # a regular file, or one line (a FIFO named *.pdparams never blocks)
        try:
            self._seen = Seen.of(st)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> PreadView:
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)

    def __len__(self) -> int:
        return self._seen.size if self._remote is None else self._remote.size

    def check_unchanged(self) -> None:
        """FormatError if the file changed since it was opened (one fstat, one stat); an object
        in a bucket is checked by the job's `byte_source.watch` (its size and ETag) instead."""
        if self._fd is not None:
            check_fd(self.path, self._fd, self._seen)

    def __getitem__(self, key):
        buf = self._buf
        if type(key) is int:  # the walk's hot path: an opcode byte inside the window
            i = key - self._base
            if 0 <= i < len(buf):
                return buf[i]
            if key < 0:
                key += len(self)
            if not 0 <= key < len(self):
                raise IndexError("PreadView index out of range")
            self._load(key, key + 1)
            return self._buf[0]
        start, stop = key.start, key.stop
        if type(start) is int and type(stop) is int and key.step is None:
            i, j = start - self._base, stop - self._base
            if 0 <= i <= j <= len(buf):
                return buf[i:j]
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("PreadView slices have step 1")
        if stop <= start:
            return b""
        i = start - self._base
        if i >= 0 and stop - self._base <= len(self._buf):
            return self._buf[i : stop - self._base]
        if stop - start > MAX_WINDOW:  # a long span (a stream's pieces): read once, not kept
            return self._pread(start, stop - start)
        self._load(start, stop)
        return self._buf[: stop - start]

    def find(self, sub: bytes, start: int = 0) -> int:
        """The offset of the first `sub` at or after `start`, or -1 (windows grow geometrically
        while it is not found: linear in the bytes searched)."""
        size = len(self)
        while start < size:
            i = start - self._base
            if 0 <= i < len(self._buf):
                j = self._buf.find(sub, i)
                if j >= 0:
                    return self._base + j
                end = self._base + len(self._buf)
                if end >= size:
                    return -1
                self._load(start, end + max(MIN_WINDOW, end - start))
            else:
                self._load(start, start + 1)
        return -1

    def _load(self, start: int, stop: int) -> None:
        """Make the window hold `[start, stop)` at least (clipped at the end of the file)."""
        going_on = self._base <= start <= self._base + len(self._buf)  # (an opcode across the end)
        self._window = min(self._window * 2, MAX_WINDOW) if going_on else MIN_WINDOW
        end = min(len(self), max(stop, start + self._window))
        self._buf, self._base = self._pread(start, end - start), start

    def _pread(self, offset: int, nbytes: int) -> bytes:
        if self._remote is not None:  # through `io.byte_source`: ranged GETs, counted, read even when planning
            with real_reads():
                return ByteSource(self.path).read(offset, nbytes)
        parts, done = [], 0
        while done < nbytes:
            try:
                got = os.pread(self._fd, nbytes - done, offset + done)
            except OSError as e:
                raise FormatError(f"{self.path}: cannot read bytes [{offset}, {offset + nbytes}): {e.strerror}") from None
            if not got:
                err = changed_error(self.path, self._seen, Seen.of(os.fstat(self._fd)))
                raise err or FormatError(
                    f"{self.path}: truncated: wanted bytes [{offset}, {offset + nbytes}) but the file "
                    f"ends at {offset + done}"
                )
            parts.append(got)
            done += len(got)
        return parts[0] if len(parts) == 1 else b"".join(parts)
