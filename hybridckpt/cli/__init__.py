"""`hybridckpt` command line: inspect, import, export, verify, logits, demo.

Errors of the project's family print one line and exit 2 (`--debug` shows the traceback);
`verify` exits 1 when tensors differ. Long jobs show a progress bar on a terminal and end with a
summary: arrays or tensors, bytes, rate, peak memory.

Ctrl-C prints one line and exits 130; the jobs write atomically (a temporary sibling renamed
into place), so an interrupted job leaves nothing, or the previous checkpoint, at its
destination. Once a job has finished, a late Ctrl-C is ignored: the job reports its success.
On a CPU host, meshes of up to 8 devices run anywhere: the CLI simulates 8 host devices.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
import warnings

from hybridckpt.errors import HybridCkptError

_INTERRUPTED = "hybridckpt: interrupted; nothing was written (a checkpoint already at the destination is kept)"


def _simulate_host_devices(count: int = 8) -> None:
    """On CPU, let meshes of up to `count` devices run by simulating host devices. Must run
    before jax initialises; it changes nothing on GPU hosts (the flag is CPU-only)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


class _Interrupt:
    """SIGINT while a job runs: remember it, silence stderr while the job unwinds (Orbax's and
    TensorStore's worker threads report the interrupt as tracebacks of their own, e.g. 'Event
    loop is closed'), and raise KeyboardInterrupt in the main thread. An error the interrupt
    causes further down is then reported as the interrupt it is, on one line (`restore`)."""

    def __init__(self, quiet_unwind: bool = True) -> None:
        self.seen = False
        self.quiet_unwind = quiet_unwind
        self._saved_fd: int | None = None

    def __call__(self, signum, frame) -> None:
        if not self.seen and self.quiet_unwind:
            sys.stderr.flush()
            self._saved_fd = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        self.seen = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        """Give stderr back (before the one line is printed). What the abandoned job leaves to
        be collected (Orbax coroutines never awaited, callbacks of closed loops) stays silent."""
        if self.quiet_unwind:
            warnings.simplefilter("ignore")
            sys.unraisablehook = lambda unraisable: None
        if self._saved_fd is not None:
            sys.stderr.flush()
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            self._saved_fd = None


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (0, 1 from verify, 2 on errors, 130 on Ctrl-C)."""
    from hybridckpt.cli.parser import build_parser

    args = build_parser().parse_args(argv)
    _simulate_host_devices()
    interrupt = _Interrupt(quiet_unwind=not args.debug)
    previous = signal.getsignal(signal.SIGINT)
    in_main_thread = _is_main_thread()
    if in_main_thread:
        signal.signal(signal.SIGINT, interrupt)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        interrupt.restore()
        print(_INTERRUPTED, file=sys.stderr)
        return 130
    except HybridCkptError as e:
        if args.debug:
            traceback.print_exc()
        if interrupt.seen:
            interrupt.restore()
            print(_INTERRUPTED, file=sys.stderr)
            return 130
        msg = " ".join(str(e).split())
        print(f"hybridckpt: error: {msg}", file=sys.stderr)
        return 2
    except BaseException:
        if not interrupt.seen:
            raise
        interrupt.restore()
        print(_INTERRUPTED, file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run() -> None:
    """The console entry point: `main()`, then exit without running interpreter-exit hooks after an
    interrupt (Orbax's and JAX's background threads would print tracebacks while shutting down)."""
    try:
        code = main()
    except BrokenPipeError:  # `hybridckpt inspect X | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    # the job is over (done or not): a late Ctrl-C must not turn its result into another
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 130:
        os._exit(130)
    sys.exit(code)
