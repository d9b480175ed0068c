"""The `hybridckpt` command's exit: once its job is done and its output flushed, the entry point
(`cli.run`) freezes the heap (`gc.freeze`), so Python's exit does not walk JAX's, Orbax's and
TensorStore's objects in the cyclic collector's passes (2-4 s of a loaded 2-core VM after an
import's summary, 0.4-0.7 s frozen: docs/benchmarks.md). Counted, not timed: the objects frozen
when the exit hooks run; the command's output and exit code are as before."""

from __future__ import annotations

import subprocess
import sys

PROBE = ("import atexit, gc, sys; "
         "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr)); "
         "sys.argv = ['hybridckpt'] + sys.argv[1:]; "
         "from hybridckpt.cli import run; run()")


def frozen_at_exit(*args: str) -> tuple[int, str, int]:
    """(exit code, stdout, objects frozen when atexit's hooks ran) of the command `args`."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    line = next(x for x in done.stderr.splitlines() if x.startswith("frozen "))
    return done.returncode, done.stdout, int(line.split()[1])


def test_the_command_exits_with_its_heap_frozen():
    code, out, frozen = frozen_at_exit("--version")
    assert code == 0 and out.startswith("hybridckpt ")
    assert frozen > 10_000  # (every object alive at the exit: the collector's passes skip them)


def test_an_error_exits_the_same_way(tmp_path):
    code, _, frozen = frozen_at_exit("inspect", str(tmp_path / "missing"))
    assert code == 2 and frozen > 10_000
