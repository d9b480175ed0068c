"""Where a job writes: one folder, complete or not at all, never over its source, one job at a time.

Every writer (our Orbax store, HF folders, Paddle unified folders) goes through `Destination`:

1. **Checked against the sources and the user's places.** An empty path, the working directory
   or a folder above it, the home folder and `/` are refused (`writers.ownership`). A
   destination that is a source, lies inside one or holds one is refused (compared after
   resolving symlinks), so `export SRC SRC --overwrite` cannot replace what it reads. What is at
   the destination: nothing or an empty folder is fine; a non-empty folder, a file or a symlink
   is refused unless `overwrite`, and even then only what hybridckpt wrote is replaced (our
   store, an export carrying `ownership.MARKER`, an empty file), and never a folder a source
   file links into (`writers.ownership`); checked again just before the swap. An export
   (`marker=True`) gets the marker written into it before it is swapped in.
2. **Locked.** `.<name>.lock` beside the destination holds an exclusive `flock` for the whole
   job and says who holds it (pid, host, command, start time): a second job writing the same
   destination is refused at once, naming the first. The lock goes with the job (the kernel
   drops it even when a job is killed; a file left by a killed job is reused and removed).
3. **Written aside, swapped in.** The writer fills `.<name>.tmp-<token>` (the folder gets the
   mode a plain `mkdir` gives under the user's umask); `commit()` renames it into place
   (with `RENAME_NOREPLACE` when nothing was there, so a folder someone created meanwhile is
   not replaced; a folder being replaced is moved aside to `.<name>.old-<token>` first and
   removed after), fsyncs the parent, and holds interrupts meanwhile (`io.interrupts`); a
   source file the job read that changed meanwhile (`io.byte_source.watch`) refuses it. A
   failure or interrupt before removes the temporary and puts back what was there: nothing is
   left beside the destination. What a job killed outright (SIGKILL, power loss) leaves is
   cleaned up by the next job that takes the lock: its temporary removed, a checkpoint it had
   moved aside put back.

A URL (`s3://bucket/prefix`, any fsspec URL) is written by `writers.remote.RemoteDestination`:
spooled locally, uploaded in place, a commit marker last.

Under `jax.distributed` the primary process checks, locks and commits; the others write into the
same temporary folder (its token agreed by the caller).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterable

from hybridckpt.errors import CheckpointError
from hybridckpt.io import byte_source, interrupts, timing
from hybridckpt.io.paths import given
from hybridckpt.io.writeback import fsync_folder
from hybridckpt.writers import ownership

RENAME_NOREPLACE = 1  # linux/fs.h


class Destination:
    """A folder a job writes (see the module doc). Use as `with Destination(dst, ...) as tmp:`,
    write into `tmp`, then `commit()` inside the block; leaving the block without a commit (an
    error) removes the temporary and keeps what was at `dst`."""

    def __new__(cls, dst: str | os.PathLike, **kw):
        """A URL destination (`s3://bucket/prefix`, ...) is a `writers.remote.RemoteDestination`."""
        from hybridckpt.io.remote.urls import parse

        url = parse(dst)
        if url is not None:
            from hybridckpt.writers.remote import RemoteDestination

            return RemoteDestination(url, **kw)
        return super().__new__(cls)

    def __init__(self, dst: str | os.PathLike, *, overwrite: bool = False, sources: Iterable = (),
                 primary: bool = True, token: str | None = None, marker: bool = False):
        self.raw = given(dst, "the destination")
        self.dst = os.path.abspath(self.raw)
        self.overwrite = overwrite
        self.marker = marker
        self.sources = [os.path.abspath(os.fspath(s)) for s in sources if s]
        self.primary = primary
        self.token = token or uuid.uuid4().hex[:8]
        parent, name = os.path.split(self.dst)
        self.tmp = os.path.join(parent, f".{name}.tmp-{self.token}")
        self.old = os.path.join(parent, f".{name}.old-{self.token}")
        self.lock_path = os.path.join(parent, f".{name}.lock")
        self._lock_fd: int | None = None
        self.committed = False

    # -- opening ---------------------------------------------------------------------------------
    def preflight(self) -> Destination:
        """The checks of step 1 alone (the sources, what is at the destination), so a job can
        refuse before it reads anything; `__enter__` makes them again."""
        if self.primary:
            ownership.check_not_a_home(self.raw, self.dst)
            check_not_over_sources(self.dst, self.sources)
            self._check_existing()
        return self

    def __enter__(self) -> str:
        if not self.primary:
            return self.tmp
        self.preflight()
        parent = os.path.dirname(self.dst)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{self.dst}: cannot create its folder: {e.strerror or e}") from e
        self._lock()
        try:
            interrupts.add_temporary(self.tmp)
            os.mkdir(self.tmp, 0o777)  # the umask applies, as for a plain mkdir
        except OSError as e:
            self._release()
            raise CheckpointError(f"{parent}: cannot write: {e.strerror or e}") from e
        except BaseException:
            self._release()
            raise
        return self.tmp

    def _check_existing(self) -> None:
        """What is at the destination (module doc, step 1): refused unless it is nothing, an
        empty folder, or (with `overwrite`) something hybridckpt wrote that no source links into."""
        d = self.dst
        if os.path.islink(d):
            what = f"is a symlink (to {os.readlink(d)})"
        elif os.path.isdir(d):
            what = "exists and is not empty" if os.listdir(d) else None
        elif os.path.lexists(d):
            what = "exists and is not a folder"
        else:
            what = None
        if what is None:
            return
        if self.overwrite and os.path.isdir(d) and not os.path.islink(d):
            ownership.check_no_links_into(d, self.sources)
        ownership.check_replaceable(d)  # (what hybridckpt did not write is named: no flag replaces it)
        if not self.overwrite:
            raise CheckpointError(f"{d}: {what}; pass overwrite=True to replace it",
                                  cli=f"{d}: {what}; pass --overwrite to replace it")

    def _lock(self) -> None:
        """Take `.<name>.lock` (see the module doc), or a CheckpointError naming the holder."""
        for _ in range(20):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise CheckpointError(f"{self.lock_path}: cannot create the lock: {e.strerror or e}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(f"{self.lock_path}: cannot lock: {e.strerror or e}") from e
                raise CheckpointError(
                    f"{self.dst}: another job is writing it ({holder}); wait for it to finish or choose "
                    f"another destination"
                ) from None
            try:  # the file we locked must still be the one at the path (a finishing job unlinks it)
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._lock_fd = fd
            interrupts.add_temporary(self.lock_path, "file")
            info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
                    "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            self._recover_stale()
            return
        raise CheckpointError(f"{self.lock_path}: the lock keeps changing hands; try again")

    def _recover_stale(self) -> None:
        """What a killed job left beside the destination (under the lock no job is writing it):
        its temporary folders go; a previous checkpoint it had moved aside during its swap comes
        back if the destination is missing, else goes."""
        parent, name = os.path.split(self.dst)
        for entry in os.listdir(parent):
            if entry.startswith(f".{name}.tmp-"):
                interrupts.remove(os.path.join(parent, entry))
        for entry in sorted(os.listdir(parent)):
            if entry.startswith(f".{name}.old-"):
                old = os.path.join(parent, entry)
                if not os.path.lexists(self.dst):
                    os.rename(old, self.dst)
                else:
                    interrupts.remove(old)

    # -- closing ---------------------------------------------------------------------------------
    def commit(self) -> None:
        """Swap the finished temporary folder into place (see the module doc)."""
        if not self.primary:
            return
        byte_source.check_watches()  # after the last read: a source that changed is not committed
        if self.marker:
            ownership.write_marker(self.tmp)
        with interrupts.committing():
            fsync_folder(self.tmp)
            moved_aside = False
            self._check_existing()  # again: what is there may have changed while the job ran
            try:
                if os.path.islink(self.dst) or (os.path.lexists(self.dst) and not os.path.isdir(self.dst)):
                    os.unlink(self.dst)  # a file or a link (never its target); checked by __enter__
                elif os.path.isdir(self.dst) and os.listdir(self.dst):
                    os.rename(self.dst, self.old)
                    moved_aside = True
                _rename_noreplace(self.tmp, self.dst)
            except OSError as e:
                if moved_aside and not os.path.lexists(self.dst):
                    os.rename(self.old, self.dst)
                raise CheckpointError(f"{self.dst}: cannot put the new checkpoint in place: {e.strerror or e}") from e
            interrupts.discard_temporary(self.tmp)
            fsync_folder(os.path.dirname(self.dst))
            if moved_aside:
                with timing.stage("remove"):  # the output --overwrite replaced (`io.timing`)
                    interrupts.remove(self.old)
            self.committed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.primary:
            return
        try:
            if not self.committed:
                interrupts.remove_settled(self.tmp)
                interrupts.discard_temporary(self.tmp)
                if os.path.lexists(self.old) and not os.path.lexists(self.dst):
                    os.rename(self.old, self.dst)
        finally:
            self._release()
        reason = io_reason(exc) if exc is not None else None
        if reason is not None:
            raise CheckpointError(f"{self.dst}: write failed: {reason}") from exc

    def _release(self) -> None:
        if self._lock_fd is not None:
            try:
                os.unlink(self.lock_path)
            except OSError:
                pass
            interrupts.discard_temporary(self.lock_path)
            os.close(self._lock_fd)  # (closing drops the flock)
            self._lock_fd = None


def io_reason(e: BaseException, *, detail: bool = False) -> str | None:
    """The OS reason of a failed write (disk full, read-only, permissions), from an OSError or
    from TensorStore's errors as Orbax raises them (`... [os_error_code='28']`; `detail`: with
    the first line of TensorStore's text after it); else None."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = str(e)
    if isinstance(e, ValueError | RuntimeError) and "os_error_code=" in text:
        code = text.split("os_error_code=", 1)[1].strip("'\"[] \n").split("'")[0]
        if code.isdigit():
            return f"{os.strerror(int(code))} ({text.splitlines()[0][:300]})" if detail else os.strerror(int(code))
        return text.splitlines()[0][:300]
    return None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _real(path: str) -> str:
    """`path` with every symlink resolved, also where its last parts do not exist yet."""
    return os.path.realpath(path)


def check_not_over_sources(dst: str, sources: Iterable[str]) -> None:
    """A CheckpointError when `dst` is a source, lies inside one, or holds one (after symlinks)."""
    d = _real(dst)
    for src in sources:
        s = _real(src)
        if os.path.isfile(s):  # a single-file source (a .safetensors, a .pdparams): its folder is fine
            inside_src, holds_src = d == s, s.startswith(d.rstrip(os.sep) + os.sep)
        else:
            inside_src = d == s or d.startswith(s.rstrip(os.sep) + os.sep)
            holds_src = s.startswith(d.rstrip(os.sep) + os.sep)
        if inside_src or holds_src:
            what = "is the source" if d == s else "is inside the source" if inside_src else "holds the source"
            raise CheckpointError(f"{dst}: the destination {what} {src}; write it somewhere else")


_libc = None


def _rename_noreplace(src: str, dst: str) -> None:
    """rename(2) that fails with EEXIST instead of replacing `dst` (Linux renameat2); a plain
    rename where the call is missing (which replaces only an empty folder)."""
    global _libc
    if sys.platform.startswith("linux"):
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(_libc, "renameat2", None)
        if fn is not None:
            at_fdcwd = -100
            if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), RENAME_NOREPLACE) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EINVAL):
                if err == errno.EEXIST and os.path.isdir(dst) and not os.listdir(dst):
                    os.rename(src, dst)  # an empty folder at the destination is replaced
                    return
                raise OSError(err, os.strerror(err), dst)
    os.rename(src, dst)
