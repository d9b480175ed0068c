"""The one way a source file is opened for reading: a regular file, never a FIFO or device.

A checkpoint folder is untrusted: a FIFO named `model.pdparams` blocks `open()` until someone
writes to it (`inspect` hung forever), `/dev/zero` linked in as a shard reads zeros without end,
a character device may have side effects on open. `open_regular` opens with `O_NONBLOCK` (a FIFO
opens at once instead of waiting for a writer; the flag means nothing to a regular file) and
checks the descriptor it got with `fstat`: anything but a regular file is closed and refused in
one line naming the file and what it is. Checking the descriptor, not the path, leaves no window
for the path to be swapped between a check and the open. Symlinks are followed (the Hugging Face
cache is made of them): what they lead to must be a regular file.
"""

from __future__ import annotations

import os
import stat

from hybridckpt.errors import FormatError

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


class NotRegular(FormatError):
    """A source path that is a FIFO, device, socket or directory, not a regular file."""


def kind_of(mode: int) -> str:
    """What a non-regular `st_mode` is, in words."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return "not a regular file"


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file `path` (the caller closes it); FormatError
    naming the file when it cannot be opened or is not a regular file. Never blocks on a FIFO."""
    return open_regular_stat(path)[0]


def open_regular_stat(path: str) -> tuple[int, os.stat_result]:
    """`open_regular` and the one fstat it made (a caller that records what the file is at open
    needs no second one)."""
    from hybridckpt.io.remote.view import refuse_whole_read

    if isinstance(path, str):
        refuse_whole_read(path)  # a placeholder of an object in a bucket: no byte of it is here
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FormatError(f"{path}: cannot open: {e.strerror}") from e
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise FormatError(f"{path}: cannot open: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegular(f"{path}: {kind_of(st.st_mode)}, not a regular file; refused as a checkpoint file")
    return fd, st


def open_regular_file(path: str):
    """`open(path, "rb")` through `open_regular`: a binary file object of a regular file."""
    return os.fdopen(open_regular(path), "rb")
