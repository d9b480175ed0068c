"""Start writing a file's dirty pages to disk early, so the closing `fsync` has little left;
and `fsync_folder`, which makes the names of files written into a folder durable.

A writer that fsyncs once at the end leaves the disk idle while it fills the page cache, then
waits for every byte. `start_writeback(fd, offset, nbytes)` asks Linux to begin writing that
range now (`sync_file_range(..., SYNC_FILE_RANGE_WRITE)`: asynchronous, no durability promise:
the final fsync still gives that). Elsewhere, or where libc lacks it, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from hybridckpt.io import timing

SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h

_sync_file_range = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _sync_file_range = _libc.sync_file_range
        _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        _sync_file_range.restype = ctypes.c_int
    except (OSError, AttributeError):
        _sync_file_range = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Begin writing bytes `[offset, offset + nbytes)` of `fd` to disk; returns at once."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # best effort: errors ignored


def fsync_folder(path: str) -> None:
    """fsync a folder, so the names of the files created or renamed in it are durable too."""
    with timing.stage("sync"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
