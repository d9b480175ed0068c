"""`io.heap.share_arenas`: the threads started after it make no malloc arena of their own, and the
import job calls it before its reader threads start (issue 42: the readers' arenas, one each, held
~200 MiB of freed buffers at the peak of a 1.5 GiB FSDP2 import). Counted with glibc's own
`malloc_stats` (one "Arena N:" line per arena), in a fresh process each: no timing, no RSS."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hybridckpt.io import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="glibc's malloc arenas only")

THREADS = 4
CHILD = textwrap.dedent("""
    import ctypes, sys, threading
    import numpy as np
    from hybridckpt.io import heap

    libc = ctypes.CDLL("libc.so.6")
    if sys.argv[1] == "share":
        assert heap.share_arenas()
    start = threading.Barrier({n})
    held = threading.Barrier({n} + 1)
    bufs = []

    def work():
        start.wait()  # all {n} alive and allocating at once: none can take a finished one's arena
        bufs.append(np.ones(2 << 20, np.uint8))
        held.wait()

    threads = [threading.Thread(target=work) for _ in range({n})]
    sys.stdout.flush()
    libc.malloc_stats()  # (to stderr)
    print("--", file=sys.stderr, flush=True)
    for t in threads:
        t.start()
    held.wait()
    libc.malloc_stats()
    for t in threads:
        t.join()
""").format(n=THREADS)


def arenas(mode: str) -> tuple[int, int]:
    """(arenas before the threads start, arenas while they hold their buffers) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, check=True)
    before, _, after = out.stderr.partition("--")
    return before.count("Arena "), after.count("Arena ")


def test_threads_after_share_arenas_make_no_arena_of_their_own():
    b, a = arenas("apart")
    assert a >= b + THREADS  # as glibc does by default: a new arena per thread
    b, a = arenas("share")
    assert a == b  # shared: the arenas there were serve the new threads


def test_the_cli_import_shares_arenas_before_its_readers_start_and_the_library_does_not(tmp_path, monkeypatch):
    """`hybridckpt import` owns its process and shares the arenas before any reader starts; the
    library's `import_checkpoint` runs inside a caller's process and leaves that process-wide,
    permanent setting to its caller."""
    from hybridckpt import jobs
    from hybridckpt.cli import main
    from hybridckpt.demo import sample_path
    from hybridckpt.lazy import parallel

    calls: list[str] = []
    monkeypatch.setattr(heap, "share_arenas", lambda: calls.append("share") or True)
    real_pool = parallel.pool

    def pool():
        calls.append("pool")
        return real_pool()

    monkeypatch.setattr(parallel, "pool", pool)
    jobs.import_checkpoint(sample_path(), str(tmp_path / "api"))
    assert "pool" in calls and "share" not in calls  # (the library: the readers ran, no arena setting)
    calls.clear()
    assert main(["import", sample_path(), str(tmp_path / "cli"), "--quiet"]) == 0
    assert calls[0] == "share" and calls.count("share") == 1
    assert "pool" in calls  # (the readers ran, after it)
