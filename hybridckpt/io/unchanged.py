"""Files that change while they are read: what a file was when first read, and the one-line error
when it is no longer that.

A checkpoint can be rewritten, truncated or replaced by another process while a job reads it (a
training run still saving, a copy still arriving, a user's `truncate`). Its bytes would then be
a mix of two versions, or zeros where a shrunk file was extended again, and nothing in the bytes
themselves says so. What does: the file's size, its modification time (ns) and its identity
(device, inode) as `fstat` gives them, taken when a job first reads the file and again after its
last read (`byte_source.watch`: before a job's output is committed) or at a short read. Any
difference is a `FormatError` in one line naming the file and what changed:
`X changed while it was read: size 123 -> 100`.

Cost: one `fstat` when a job first reads a file and one `fstat` plus one `stat` (was the path
replaced by another file?) after; nothing per read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridckpt.errors import FormatError


@dataclass(frozen=True)
class Seen:
    """What a file was: `size` (bytes), `mtime_ns`, and its identity `(dev, ino)`."""

    size: int
    mtime_ns: int
    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> Seen:
        return cls(st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)


def difference(before: Seen, after: Seen) -> str | None:
    """What changed from `before` to `after`, in words (None: nothing)."""
    if (before.dev, before.ino) != (after.dev, after.ino):
        return f"replaced by another file (inode {before.ino} -> {after.ino})"
    if before.size != after.size:
        return f"size {before.size} -> {after.size}"
    if before.mtime_ns != after.mtime_ns:
        return f"rewritten at the same size {before.size} (mtime {before.mtime_ns} -> {after.mtime_ns} ns)"
    return None


def changed_error(path: str, before: Seen, after: Seen) -> FormatError | None:
    """The one-line error for `path` if it changed from `before` to `after`, else None."""
    what = difference(before, after)
    return None if what is None else FormatError(f"{path} changed while it was read: {what}")


def check_fd(path: str, fd: int, before: Seen, *, by_path: bool = True) -> None:
    """Raise `changed_error` if the open file `fd` of `path` is no longer `before` (one fstat),
    or (`by_path`) `path` now names another file (one stat)."""
    err = changed_error(path, before, Seen.of(os.fstat(fd)))
    if err is None and by_path:
        try:
            err = changed_error(path, before, Seen.of(os.stat(path)))
        except OSError as e:
            err = FormatError(f"{path} changed while it was read: {e.strerror or e}")
    if err is not None:
        raise err
