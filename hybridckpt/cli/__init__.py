"""`hybridckpt` command line: inspect, import, export, verify, logits, demo.

Errors of the project's family print one line and exit 2 (`--debug` shows the traceback);
`verify` exits 1 when tensors differ. Long jobs show a progress bar on a terminal and end with a
summary: arrays or tensors, bytes, rate, peak memory.

Ctrl-C at any moment prints one line and exits 130; the jobs write atomically (a temporary
sibling renamed into place, `writers.destination`), and the handler removes what is being written, so
an interrupted job leaves nothing, or the previous checkpoint, at its destination and nothing
beside it. Once a job has put its output in place, a late Ctrl-C is ignored: the job reports its
success.
On a CPU host, meshes of up to 8 devices run anywhere: the CLI simulates 8 host devices.
"""

from __future__ import annotations

import os
import signal
import sys

_INTERRUPTED = "hybridckpt: interrupted; nothing was written (a checkpoint already at the destination is kept)"


def _running_as_the_command() -> bool:
    """Whether this process is the `hybridckpt` command (its console script, or `python -m
    hybridckpt` / `python -m hybridckpt.cli`), not a program that imports the library."""
    argv = list(getattr(sys, "orig_argv", sys.argv))  # (runpy has not set `__main__` yet under -m)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1].split(".")[0] == "hybridckpt":
        return True
    return script in ("hybridckpt", "hybridckpt.exe")


def _interrupted_before_the_job(signum, frame) -> None:
    """SIGINT while the command is still starting (nothing written yet): one line, exit 130."""
    os.write(2, (_INTERRUPTED + "\n").encode())
    os._exit(130)


if _running_as_the_command():  # first of all: the rest of this module (and `run`) installs the full handler
    try:
        signal.signal(signal.SIGINT, _interrupted_before_the_job)
    except ValueError:  # not the main thread: not the command starting
        pass

import traceback  # noqa: E402


def _simulate_host_devices(count: int = 8) -> None:
    """On CPU, let meshes of up to `count` devices run by simulating host devices. Must run
    before jax initialises; it changes nothing on GPU hosts (the flag is CPU-only)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


class _OnInterrupt:
    """The CLI's SIGINT handler, installed before anything else runs: print one line, remove
    what the job is writing (`io.interrupts.temporaries`: its temporary folder and lock), exit
    130 at once, without unwinding through Orbax's and TensorStore's threads (whose own
    reports of an unwinding job were tracebacks, and sometimes a crash at exit). While a
    finished folder is swapped into place, and after, the signal is ignored: the job has done
    its writing and reports its success. With --debug the stack where it arrived is printed."""

    def __init__(self) -> None:
        self.debug = False

    def __call__(self, signum, frame) -> None:
        interrupts = sys.modules.get("hybridckpt.io.interrupts")  # (maybe still being imported)
        ready = interrupts is not None and hasattr(interrupts, "remove_temporaries")
        if ready and interrupts.committed():
            return
        if self.debug and frame is not None:
            traceback.print_stack(frame)
        try:
            os.write(2, (_INTERRUPTED + "\n").encode())
            if ready:
                interrupts.remove_temporaries()
        finally:
            os._exit(130)


_ON_INTERRUPT = _OnInterrupt()


if _running_as_the_command():  # the full handler, now that it is defined (see `run`)
    try:
        signal.signal(signal.SIGINT, _ON_INTERRUPT)
    except ValueError:
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (0, 1 from verify, 2 on errors, 130 on Ctrl-C)."""
    from hybridckpt.cli.parser import build_parser
    from hybridckpt.errors import HybridCkptError

    in_main_thread = _is_main_thread()
    previous = signal.getsignal(signal.SIGINT) if in_main_thread else None
    if in_main_thread:
        signal.signal(signal.SIGINT, _ON_INTERRUPT)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help (0), or a usage error already printed as one line (2)
            return e.code if isinstance(e.code, int) else 2
        _ON_INTERRUPT.debug = bool(args.debug)
        _simulate_host_devices()
        try:
            return args.fn(args)
        except HybridCkptError as e:
            if args.debug:
                traceback.print_exc()
            msg = " ".join(str(e).split())
            print(f"hybridckpt: error: {msg}", file=sys.stderr)
            return 2
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run() -> None:
    """The console entry point: the SIGINT handler first (an interrupt at any moment is one line
    and exit 130), then `main()`."""
    signal.signal(signal.SIGINT, _ON_INTERRUPT)
    from hybridckpt.io import interrupts  # noqa: F401 - loaded before any signal needs it

    try:
        code = main()
    except BrokenPipeError:  # `hybridckpt inspect X | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    # the job is over (done or not): a late Ctrl-C must not turn its result into another
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
