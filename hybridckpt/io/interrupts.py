"""What an interrupt must clean up, and when it must wait: shared by the writers and the CLI.

A job writes into temporary siblings of its destination (`writers.destination`) and renames them into
place. `temporaries()` lists the paths written now (a folder being filled, its lock file): the
CLI's SIGINT handler removes them and exits 130 at once, instead of unwinding through Orbax's and
TensorStore's threads. `committing()` marks the few renames that swap a finished folder in:
an interrupt there is held until they are done (a half-swapped destination would lose both the
old and the new checkpoint), and a job whose destination is in place has succeeded, so a late
interrupt is ignored (`committed()`).

Library callers (no CLI handler) keep Python's KeyboardInterrupt: the writers' `finally` blocks
remove their temporaries, and `committing()` defers the interrupt past the renames, then raises
it.
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


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """Hold SIGINT while a finished folder is swapped into place; afterwards the job counts as
    committed. In the main thread a SIGINT that arrives meanwhile is delivered afterwards to
    the handler that was installed (Python's default raises KeyboardInterrupt then)."""
    pending: list = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    if main:
        signal.signal(signal.SIGINT, lambda signum, frame: pending.append(frame))
    with _lock:
        _state["committing"] += 1
    try:
        yield
        with _lock:
            _state["committed"] = True
    finally:
        with _lock:
            _state["committing"] -= 1
        if main:
            signal.signal(signal.SIGINT, previous)
            if pending and callable(previous):
                previous(signal.SIGINT, pending[-1])


def remove_temporaries(settle_s: float = 0.3) -> None:
    """Remove every registered temporary, again while late writes from other threads put files
    back, until none reappears for `settle_s` seconds (at most 10 rounds)."""
    for _ in range(10):
        for path, kind in list(_temporaries.items()):
            remove(path, kind)
        time.sleep(settle_s / 3)
        if not any(os.path.lexists(p) for p in _temporaries):
            time.sleep(settle_s)
            if not any(os.path.lexists(p) for p in _temporaries):
                break
    with _lock:
        _temporaries.clear()


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
