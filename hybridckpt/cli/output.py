"""What the CLI prints: the progress bar, sizes and rates in units that fit, one-line summaries.

Sizes are bytes shown as B / kB / MB / GB (powers of 1000); rates as MB/s below 1 GB/s, else GB/s;
peak memory is the process's own peak resident set (`VmHWM`) in GiB.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
from typing import Any


def job_finished() -> None:
    """Called by a command once its job has returned: from here on a Ctrl-C or SIGTERM is
    ignored, so a finished job reports its success (`cli.main` puts the previous handlers back)."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def peak_rss_gib() -> float:
    """This process's peak resident set in GiB: `VmHWM` of /proc/self/status, the peak of its own
    memory map. Not `ru_maxrss`: Linux carries the high-water RSS of the process that forked this
    one into it at exec, so a CLI started from a large process (a notebook, a trainer) reported
    that process's peak. `ru_maxrss` only where /proc has no VmHWM (not Linux)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024**2  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def rate(nbytes: float, seconds: float) -> str:
    per_s = nbytes / seconds if seconds > 0 else 0.0
    return f"{per_s / 1e9:.2f} GB/s" if per_s >= 1e9 else f"{per_s / 1e6:.1f} MB/s"


def summary(what: str, count: int, nbytes: int, seconds: float) -> str:
    """`<count> <what>, <size> in <s> (<rate>), peak memory <GiB>`."""
    return (
        f"{count} {what}, {size(nbytes)} in {seconds:.2f} s ({rate(nbytes, seconds)}), "
        f"peak memory {peak_rss_gib():.2f} GiB"
    )


def compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class _Screen:
    """The terminal stream a progress bar draws on, as a file for rich's Console; `close()` erases
    the bar and drops every later write, so rich's refresh thread (10 frames a second) cannot
    draw it again after an interrupt's last line. `close()` takes the write lock, never rich's
    own (the main thread may have been interrupted holding it)."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()
        self.closed = False
        self.live = None  # the rich Live drawing here (for the height of its last frame)

    def write(self, text: str) -> int:
        with self.lock:
            if not self.closed:
                self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if not self.closed:
                self.stream.flush()

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:  # each line of the bar erased, back to its first (what rich writes before a new frame)
                erase = self.live._live_render.position_cursor().segment.text
            except Exception:  # noqa: BLE001 - another rich: erase the current line
                erase = "\r\x1b[2K"
            try:
                self.stream.write(erase)
                self.stream.flush()
            except (OSError, ValueError):
                pass


_SCREENS: list[_Screen] = []


def stop_drawing() -> None:
    """Erase every progress bar and stop it drawing, for good (the CLI's interrupt handler,
    before its last line)."""
    for screen in list(_SCREENS):
        screen.close()


class Progress:
    """A rich progress bar over bytes on stderr when it is a terminal; silent otherwise.

    `total` (bytes) is set by the job once it knows it (`set_total`), so the bar shows
    `done/total` and an ETA instead of `done/?`. It draws through a `_Screen` that
    `stop_drawing()` closes.
    """

    def __init__(self, what: str, quiet: bool = False):
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            self.screen = _Screen(sys.stderr)
            self.bar = RichProgress(
                TextColumn(f"{what} [progress.description]{{task.description}}"),
                BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                transient=True, console=Console(file=self.screen, force_terminal=True),
            )
            self.screen.live = self.bar.live
            self.task = self.bar.add_task("", total=None)

    def __enter__(self) -> Progress:
        if self.bar:
            _SCREENS.append(self.screen)
            self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar:
            self.bar.stop()
            _SCREENS.remove(self.screen)

    def set_total(self, nbytes: int) -> None:
        if self.bar:
            self.bar.update(self.task, total=nbytes)

    def __call__(self, name: str, nbytes: int) -> None:
        if self.bar:
            self.bar.update(self.task, advance=nbytes, description=name[-40:])
