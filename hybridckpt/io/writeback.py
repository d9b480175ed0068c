"""Start writing a file's dirty pages to disk early, so the closing `fsync` has little left;
`fsync_folder`, which makes the names of files written into a folder durable; and
`FilesystemSync`, one flush of a whole filesystem for many files written into it.

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

SYNCFS_ERRORS_SINCE = (5, 8)  # Linux: syncfs reports writeback errors (errseq of the superblock) from 5.8

_sync_file_range = None
_syncfs = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _sync_file_range = _libc.sync_file_range
        _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        _sync_file_range.restype = ctypes.c_int
        _syncfs = _libc.syncfs
        _syncfs.argtypes = [ctypes.c_int]
        _syncfs.restype = ctypes.c_int
    except (OSError, AttributeError):  # a libc without them: what was found is kept
        pass


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


def _kernel_version() -> tuple[int, ...]:
    parts = []
    for p in os.uname().release.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


class FilesystemSync:
    """One `syncfs` of the filesystem holding `folder`, in place of an fsync per file written
    into it (the chunk files of a raw import: one file per chunk, so an fsync per file was an
    fsync per chunk, each a journal commit and a device cache flush).

    Opened before the files are written (`FilesystemSync.open(folder)`: the descriptor samples
    the filesystem's writeback-error state then, so `sync()` reports any error of writing back
    those files' pages, however early it happened), `sync()` after: it writes every dirty page
    and inode of that filesystem, commits its journal and flushes the device's cache, and
    returns once all of it is durable (or raises OSError). That is what the fsync of each file
    and of each folder gave together, for every file written since the open: their bytes,
    sizes, block maps and names.

    `open` returns None (the caller fsyncs each file) where that promise does not hold or is
    not known to: not Linux, a kernel before 5.8 (syncfs reported no writeback errors), libc
    without syncfs, or a filesystem not on a block device (major device number 0: NFS, FUSE,
    tmpfs, overlay, btrfs' anonymous devices), whose syncfs may not reach the server or the
    disk the way its fsync does."""

    def __init__(self, fd: int, folder: str):
        self.fd, self.folder = fd, folder

    @classmethod
    def open(cls, folder: str) -> FilesystemSync | None:
        if _syncfs is None or _kernel_version() < SYNCFS_ERRORS_SINCE:
            return None
        try:
            if os.major(os.stat(folder).st_dev) == 0:
                return None
            return cls(os.open(folder, os.O_RDONLY), folder)
        except OSError:
            return None

    def sync(self) -> None:
        """Make every file written into the filesystem since `open` durable (see the class doc)."""
        with timing.stage("sync"):
            if _syncfs(self.fd) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"{self.folder}: syncfs failed: {os.strerror(e)}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
