"""`share_arenas`: the C heap's malloc arenas shared by the threads a job starts after it, instead
of one new arena per thread.

glibc gives a thread that allocates while every arena is busy an arena of its own (up to 8 per
core), and an arena keeps what its thread freed for that thread's next allocations: it gives
pages back to the system only from its top, and only past a trim threshold that its dynamic
mmap threshold raises to 64 MiB once a buffer of 32 MiB was freed. An import's 4 reader threads
and its planner allocate and free buffers of 1-32 MiB for every tile (slab spans, packed runs,
strips; `io.aligned_pool` lends the tiles themselves), so each of their 5 arenas grew to 25-44
MiB of free memory (`malloc_stats` at the end of a 1.5 GiB FSDP2 import: 200 MiB held, 0.6 MiB in
use): most of the peak RSS beyond the tiles in flight (docs/benchmarks.md, "Run 6").

`share_arenas()` sets `M_ARENA_MAX` to 1 (`mallopt`), so the threads started after it reuse the
arenas that exist (mostly the main one, which the GIL already serialises: numpy allocates with
it held) and one thread's freed buffers serve the next thread's: the same import peaks ~70 MiB
lower, with fewer page faults (memory reused, not zeroed again). Best effort: nothing off glibc,
and glibc fixes its arena limit once a process has more than 8 arenas (then the call changes
nothing); process-wide and kept after the job (an arena limit cannot be undone).
"""

from __future__ import annotations

import ctypes
import functools

M_ARENA_MAX = -8  # glibc's malloc.h


@functools.cache
def _libc():
    """glibc's handle (None elsewhere: musl, macOS)."""
    try:  # (the process's own symbols: no `find_library`, which runs ldconfig)
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    return libc is not None and bool(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)))


def share_arenas() -> bool:
    """Threads started from now on share the malloc arenas that exist (see the module doc);
    True where glibc took the setting. Call it before the job's worker threads first allocate."""
    return _mallopt(M_ARENA_MAX, 1)
