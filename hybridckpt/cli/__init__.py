"""`hybridckpt` command line: inspect, import, export, verify, logits, demo.

Errors of the project's family print one line and exit 2 (`--debug` shows the traceback);
`verify` exits 1 when tensors differ. Long jobs show a progress bar on a terminal and end with a
summary: arrays or tensors, bytes, rate, peak memory.

Ctrl-C at any moment prints one line and exits 130; SIGTERM (what `timeout`, `kill` and job
schedulers send) the same, exiting 143 (128 + the signal's number, as a shell reports a process
it ended). A second signal while the first is handled adds nothing. The jobs write atomically (a
temporary sibling renamed into place, `writers.destination`), and the handler removes what is
being written, so an interrupted job leaves nothing, or the previous checkpoint, at its
destination and nothing beside it; the progress bar is erased first and never drawn again. Once
a job has put its output in place, a late signal is ignored: the job reports its success.
On a CPU host, meshes of up to 8 devices run anywhere: the CLI simulates 8 host devices.
"""

from __future__ import annotations

import os
import signal
import sys

_INTERRUPTED = "hybridckpt: interrupted; nothing was written (a checkpoint already at the destination is kept)"
_TERMINATED = "hybridckpt: terminated (SIGTERM); nothing was written (a checkpoint already at the destination is kept)"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _line(signum: int) -> bytes:
    return ((_TERMINATED if signum == signal.SIGTERM else _INTERRUPTED) + "\n").encode()


def _install(handler) -> None:
    """`handler` for SIGINT and SIGTERM (the main thread only; elsewhere nothing)."""
    try:
        for s in _SIGNALS:
            signal.signal(s, handler)
    except ValueError:  # not the main thread
        pass


def _running_as_the_command() -> bool:
    """Whether this process is the `hybridckpt` command (its console script, or `python -m
    hybridckpt` / `python -m hybridckpt.cli`), not a program that imports the library."""
    argv = list(getattr(sys, "orig_argv", sys.argv))  # (runpy has not set `__main__` yet under -m)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1].split(".")[0] == "hybridckpt":
        return True
    return script in ("hybridckpt", "hybridckpt.exe")


def _interrupted_before_the_job(signum, frame) -> None:
    """SIGINT or SIGTERM while the command is still starting (nothing written yet): one line,
    exit 128 + the signal's number."""
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_IGN)  # a second signal: nothing more
    os.write(2, _line(signum))
    os._exit(128 + signum)


if _running_as_the_command():  # first of all: the rest of this module (and `run`) installs the full handler
    _install(_interrupted_before_the_job)

import traceback  # noqa: E402


def _simulate_host_devices(count: int = 8) -> None:
    """On CPU, let meshes of up to `count` devices run by simulating host devices. Must run
    before jax initialises; it changes nothing on GPU hosts (the flag is CPU-only)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


class _OnInterrupt:
    """The CLI's SIGINT and SIGTERM handler, installed before anything else runs: erase the
    progress bar and keep it from drawing again, print one line, close stderr (what Orbax's and
    TensorStore's threads say as their files vanish is not the user's business), remove what
    the job is writing (`io.interrupts.clear_for_exit`: its temporary folder and lock) and exit
    128 + the signal's number at once, without unwinding through those threads (whose own
    reports of an unwinding job were tracebacks, and sometimes a crash at exit). Only the first
    signal does this; later ones are ignored. While a finished folder is swapped into place,
    and after, the signal is ignored: the job has done its writing and reports its success.
    With --debug the stack where it arrived is printed."""

    def __init__(self) -> None:
        self.debug = False

    def __call__(self, signum, frame) -> None:
        interrupts = sys.modules.get("hybridckpt.io.interrupts")  # (maybe still being imported)
        ready = interrupts is not None and hasattr(interrupts, "clear_for_exit")
        if ready and interrupts.committed():
            return
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)  # a second signal: nothing more
        try:
            output = sys.modules.get("hybridckpt.cli.output")
            if output is not None and hasattr(output, "stop_drawing"):
                output.stop_drawing()
            if self.debug and frame is not None:
                traceback.print_stack(frame, file=sys.__stderr__)
                sys.__stderr__.flush()
            os.write(2, _line(signum))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            if ready:
                interrupts.clear_for_exit()
        finally:
            os._exit(128 + signum)


_ON_INTERRUPT = _OnInterrupt()


if _running_as_the_command():  # the full handler, now that it is defined (see `run`)
    _install(_ON_INTERRUPT)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (0, 1 from verify, 2 on errors; a signal exits
    130 (SIGINT) or 143 (SIGTERM) from its handler)."""
    from hybridckpt.cli.parser import build_parser
    from hybridckpt.errors import HybridCkptError
    from hybridckpt.io.remote.view import displayed

    in_main_thread = _is_main_thread()
    previous = {s: signal.getsignal(s) for s in _SIGNALS} if in_main_thread else {}
    _install(_ON_INTERRUPT)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help (0), or a usage error already printed as one line (2)
            return e.code if isinstance(e.code, int) else 2
        _ON_INTERRUPT.debug = bool(args.debug)
        _simulate_host_devices()
        try:
            return args.fn(args)
        except Exception as e:
            msg = e.cli_message if isinstance(e, HybridCkptError) else _backend_failure()
            if msg is None:
                raise
            if args.debug:
                traceback.print_exc()
            msg = " ".join(displayed(msg).split())  # a bucket's local view named by its URL
            print(f"hybridckpt: error: {msg}", file=sys.stderr)
            return 2
    finally:
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)


def _backend_failure() -> str | None:
    """After an unexpected error: when JAX was loaded and cannot start its backend (e.g.
    JAX_PLATFORMS=cuda with a CPU-only jaxlib: an AssertionError or RuntimeError deep in JAX),
    one line saying so and what to install; else None (the error is not that)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        jax.devices()
        return None
    except Exception as e:  # noqa: BLE001 - whatever JAX raises, the backend did not start
        why = " ".join(str(e).split("(set JAX_PLATFORMS")[0].split())[:200] or "no installed JAX plugin provides it"
    platforms = os.environ.get("JAX_PLATFORMS", "")
    cuda = "install JAX's CUDA build: pip install 'hybridckpt[cuda]' (that is, jax[cuda12])"
    tpu = "install JAX's TPU build: pip install 'jax[tpu]'"
    fix = cuda if "cuda" in platforms or "gpu" in platforms else tpu if "tpu" in platforms else f"{cuda}; or {tpu}"
    return (f"JAX cannot start the backend JAX_PLATFORMS={platforms!r} asks for ({why}); {fix}; "
            "or unset JAX_PLATFORMS to run on the CPU")


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run() -> None:
    """The console entry point: the SIGINT/SIGTERM handler first (a signal at any moment is one
    line and exit 130 or 143), then `main()`."""
    _install(_ON_INTERRUPT)
    from hybridckpt.cli.profile import own_process
    from hybridckpt.io import interrupts  # noqa: F401 - loaded before any signal needs it
    from hybridckpt.io.gc_pause import freeze_after_loading

    own_process()  # (an account of its time covers the process from its start: `cli.profile`)
    freeze_after_loading()  # this process lives for one command: the objects of its modules frozen once loaded

    try:
        code = main()
    except BrokenPipeError:  # `hybridckpt inspect X | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    # the job is over (done or not): a late signal must not turn its result into another
    _install(signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    import gc

    # Nothing of the job is needed past here, yet Python's exit walks the whole heap (JAX's, Orbax's
    # and TensorStore's modules and objects) in the cyclic collector's passes: 2-4 s of a loaded
    # 2-core VM after an import's summary, 0.4-0.7 s with the heap frozen (issue 42; the process's
    # wall, not the job's). Objects are still freed by their counts, files closed, atexit's hooks run.
    gc.freeze()
    sys.exit(code)
