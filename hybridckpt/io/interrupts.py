"""What an interrupt must clean up, and when it must wait: shared by the writers and the CLI.

A job writes into temporary siblings of its destination (`writers.destination`) and renames them into
place. `temporaries()` lists the paths written now (a folder being filled, its lock file): the
CLI's SIGINT/SIGTERM handler removes them (`clear_for_exit`) and exits at once, instead of
unwinding through Orbax's and TensorStore's threads. `committing()` marks the few renames that
swap a finished folder in: an interrupt (SIGINT or SIGTERM) there is held until they are done (a
half-swapped destination would lose both the old and the new checkpoint), and a job whose
destination is in place has succeeded, so a late interrupt is ignored (`committed()`).

Library callers (no CLI handler) keep Python's KeyboardInterrupt: the writers' `finally` blocks
remove their temporaries, and `committing()` defers the interrupt past the renames, then raises
it (a SIGTERM left at its default is delivered again then, and ends the process).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator

_lock = threading.RLock()
_temporaries: dict[str, str] = {}  # path -> "dir" | "file"
_state = {"committing": 0, "committed": False}


def add_temporary(path: str, kind: str = "dir") -> None:
    """`path` is being written; remove it if the job is interrupted."""
    with _lock:
        _temporaries[os.fspath(path)] = kind
        _state["committed"] = False


def discard_temporary(path: str) -> None:
    with _lock:
        _temporaries.pop(os.fspath(path), None)


def temporaries() -> list[str]:
    with _lock:
        return list(_temporaries)


def committed() -> bool:
    """A destination was swapped in since the last temporary was added: the job has done its
    writing (a late interrupt is ignored) or is doing so now."""
    with _lock:
        return _state["committed"] or _state["committing"] > 0


HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while a finished folder is swapped into place; afterwards the job
    counts as committed. In the main thread a signal that arrives meanwhile is delivered
    afterwards to the handler that was installed (Python's default for SIGINT raises
    KeyboardInterrupt then; a SIGTERM at its default ends the process then)."""
    pending: list = []
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in HELD} if main else {}
    previous = {s: h for s, h in previous.items() if h is not None}  # (not installed from Python: left alone)
    for s in previous:
        signal.signal(s, lambda signum, frame: pending.append((signum, frame)))
    with _lock:
        _state["committing"] += 1
    try:
        yield
        with _lock:
            _state["committed"] = True
    finally:
        with _lock:
            _state["committing"] -= 1
        for s, h in previous.items():
            signal.signal(s, h)
        if pending:
            signum, frame = pending[-1]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def clear_for_exit() -> None:
    """Remove every registered temporary for a process that exits right after (the CLI's
    interrupt handler), without waiting on the threads still writing (TensorStore's, the
    readers'): each folder is renamed aside and a plain file takes its name, so a late write
    into it fails (not a folder) instead of making it again; the renamed folder is removed by
    `rm -rf` (a child process: no contention for the GIL with those threads), then the plain
    files, then the lock files. What those threads report meanwhile is theirs to drop (the
    caller closes stderr first)."""
    with _lock:
        items = list(_temporaries.items())
        _temporaries.clear()
    blocks, gone = [], []
    for path in (p for p, kind in items if kind == "dir"):
        for i in range(100):
            aside = f"{path}.gone-{i}"
            try:
                os.rename(path, aside)
                gone.append(aside)
            except FileNotFoundError:
                pass
            except OSError:
                remove(path)
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:  # a writer made it again in between: once more
                continue
            except OSError:  # the parent itself is gone or unwritable: nothing to hold
                break
            blocks.append(path)
            break
    _remove_trees(gone)
    for path in blocks:
        remove(path, "file")
    for path, kind in items:
        if kind != "dir":
            remove(path, kind)


def _remove_trees(paths: list[str]) -> None:
    """`rm -rf paths` in a child process, or `remove` each where that cannot start."""
    if not paths:
        return
    try:
        pid = os.posix_spawnp("rm", ["rm", "-rf", "--", *paths], dict(os.environ))
        os.waitpid(pid, 0)
    except OSError:
        pass
    for path in paths:
        remove(path)


def remove_settled(path: str, tries: int = 50) -> None:
    """Remove the folder `path`, again while writes still in flight (TensorStore threads after a
    failed save) put files back into it; gives up after about `tries` x 0.1 s."""
    for _ in range(tries):
        remove(path)
        if not os.path.lexists(path):
            time.sleep(0.1)  # a late writer may recreate it: look once more
            if not os.path.lexists(path):
                return
        time.sleep(0.1)


def remove(path: str, kind: str = "dir") -> None:
    """Remove a file or a folder tree; nothing if it is gone."""
    try:
        if kind == "dir" and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
