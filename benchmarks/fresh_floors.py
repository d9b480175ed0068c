"""The fresh-memory read floors a restore is held to, measured beside it round by round (issue 42).

A restore's arrays are memory its process has not touched before: each page is allocated and
zeroed by the kernel as the bytes land in it, which `cat` (one small buffer the CPU cache holds)
and an O_DIRECT read into one reused buffer never pay. The floor of a restore is therefore the
bytes it needs read into fresh memory held to the end, in whichever way is fastest: each way of
`FLOOR_THREADS` x `FLOOR_PAGES` runs in its own fresh process, and the fastest counts.

The pages, each a way a restore could take:
- "small": 4 KiB pages faulted in by one `MADV_POPULATE_WRITE` before the read (`populate`: as
  the restore's arrays were until the thirteenth stop);
- "fault": 4 KiB pages faulted in by the read itself (the kernel's copy into them; as the
  restore's arrays are now: `io.page_advice`);
- "huge": numpy's own (transparent huge pages from 4 MiB, faulted in by the read).

What makes the floor fair to the restore beside it, measured on the 2-core VM of
docs/benchmarks.md ("Thirteenth stop"). On a VM whose balloon reports free memory to the host
(`virtio_balloon` free page reporting) a fresh page is cheap or dear by its history: memory
another process freed a moment before is cheap, memory idle for seconds takes the host's faults
at its first touch. Run back to back, the floors' ways each took memory the way before had just
freed, while the restore, after `cat` and its modules, did not: at 4.7 GB, 2 threads with 4 KiB
pages took a median 1.66 s right after a restore (the restores 2.47 s, 6 rounds) and 1.92 s after
the same `cat` a restore follows (the restores 2.02 s, 4 rounds). So:
- each way's process first loads the modules the restore's process loads
  (`load_restore_modules`), so that it starts reading as long after the last exit as a restore;
- every run, each way and the restore, is prepared the same way (`prepare`: warm, the files read
  once, as the page cache holds them for a restore; cold, their pages dropped);
- the restore's place among the ways turns each round (`measured_round`'s `turn`).

And since the nineteenth stop every measured process, each way, each restore and Orbax's restore,
first backs the memory it is about to fill (`back_memory`: as many bytes as the files it reads,
touched and given back, then its peak RSS reset), so that each takes memory the host backs
already, whatever ran before it. Without it the first restore after an import took 5.1 s where
the next took 1.5 s, the same 1.19M page faults costing 8.8 against 2.1 system CPU-s (the host's
faults on memory the balloon had reported: docs/benchmarks.md, "Nineteenth stop"), while the
floor, the fastest of its ways, escaped them by chance. So the floors are what a machine without
a balloon gives every process, and stricter than before.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import floors
import numpy as np

HERE = os.path.abspath(__file__)

FLOOR_THREADS = (1, 2, 4)  # threads a fresh-buffer floor is read with (each whole files)
FLOOR_PAGES = ("small", "fault", "block", "huge")
PAGE_LABELS = {"small": "4 KiB pages populated first", "fault": "4 KiB pages faulted in by the read",
               "block": "4 KiB pages populated a block before its read", "huge": "huge pages (numpy's)"}
SMALL_PAGES = ("small", "fault", "block")  # the ways of 4 KiB pages, the pages a restore's arrays are
BLOCK_BYTES = 256 << 10  # the "block" way's step: populated, then read into, while the CPU's L2 holds it
WAYS_SEEN: list[dict] = []  # every round's ways, in order (printed with the run's rows)


def devices() -> None:
    """8 simulated CPU devices, as the benchmarks' restores and imports run on."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"


def load_restore_modules() -> None:
    """Load what a restore loads on first use, so that a restore's seconds leave it out (a
    training script that resumes has JAX, optax and the library loaded already): every model
    family's package (imported on the first config read: ~0.4 s here), and the modules of the
    optimizer state and the chunk reads (optax alone ~32 ms, ~4-8% of a 1 GB warm restore, was
    counted in the restores of the ninth and tenth stops); and JAX's backend started (its
    devices made: a program that restores onto a mesh has made the mesh's devices first; the
    plugin discovery and the CPU client took 8-11 ms of each 1.1 GB warm restore until the
    fourteenth stop, ~2-3% of it). A floor's process does the same (the same process state).
    `tests/jobs/test_bench_baselines.py` checks that a restore of params and AdamW state loads
    nothing of JAX, optax, Orbax or the library after this, and starts no backend."""
    devices()
    import jax
    import optax  # noqa: F401

    jax.devices()  # (JAX's backend started: the restore's own first call would start it)

    import hybridckpt  # noqa: F401
    import hybridckpt.containers.orbax.reader
    import hybridckpt.formats.orbax_store
    import hybridckpt.formats.registry
    import hybridckpt.io.remote.ts_writes
    import hybridckpt.jobs.restore
    import hybridckpt.optim.adamw
    import hybridckpt.optim.index_names
    import hybridckpt.optim.param_order
    import hybridckpt.optim.sgd
    import hybridckpt.optim.torch_optim
    import hybridckpt.optim.trainer_groups
    import hybridckpt.place
    import hybridckpt.store.stream_orbax  # noqa: F401
    from hybridckpt.models.family import families

    families()


def drop_pages(paths: list[str]) -> None:
    """Evict these files' clean pages from the page cache (theirs only: no root, no other file)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prepare(paths: list[str], *, direct: bool) -> None:
    """What precedes every measured run: cold (`direct`), the files' pages dropped; warm, the
    files read once to /dev/null (in the page cache, as for a restore after an import)."""
    if direct:
        drop_pages(paths)
        return
    buf = bytearray(1 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def fresh_read(paths: list[str], threads: int, pages: str, direct: bool) -> tuple[float, list[np.ndarray]]:
    """Seconds for `threads` threads, each taking the next whole file, to read `paths` into fresh
    4 KiB-aligned buffers of their sizes, all kept until the last is read (and returned, in the
    order of `paths`), backed by `pages` (`FLOOR_PAGES`); `direct` reads with O_DIRECT (the
    unaligned tail of a file through the page cache)."""
    from hybridckpt.io import direct_io, page_advice

    if pages not in FLOOR_PAGES:
        raise ValueError(f"pages={pages!r}: expected one of {FLOOR_PAGES}")
    held: list = [None] * len(paths)
    todo = iter(range(len(paths)))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def read_one(p: str) -> np.ndarray:
        n = os.path.getsize(p)
        whole = n - n % direct_io.DIRECT_ALIGN if direct else n
        buf = direct_io.aligned_empty((n,), "uint8")
        if pages != "huge":
            page_advice.no_huge_pages(buf)  # (arrays under 4 MiB: numpy never asks huge pages for them)
        if pages == "small":
            populate(buf)
        fd = direct_io.open_direct(p, os.O_RDONLY) if direct else os.open(p, os.O_RDONLY)
        if fd is None:
            raise SystemExit(f"{p}: the filesystem refused O_DIRECT")
        try:
            done = 0
            while done < whole:
                stop = min(whole, done + BLOCK_BYTES) if pages == "block" else whole
                if pages == "block":
                    populate(buf[done:stop])
                got = os.preadv(fd, [memoryview(buf)[done:stop]], done)
                if got == 0:
                    raise OSError(f"{p}: short read at {done}")
                done += got
        finally:
            os.close(fd)
        if n > whole:
            with open(p, "rb") as f:
                f.seek(whole)
                buf[whole:n] = np.frombuffer(f.read(), np.uint8)
        return buf

    def work() -> None:
        try:
            while not failed:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                held[i] = read_one(paths[i])
        except BaseException as e:  # (raised by the calling thread)
            failed.append(e)

    t0 = time.perf_counter()
    floors.run_threads(work, threads)
    dt = time.perf_counter() - t0
    if failed:
        raise failed[0]
    return dt, held


_MADV_POPULATE_WRITE = 23  # (Linux's value on every architecture; Python before 3.13 lacks the name)


def populate(array: np.ndarray) -> bool:
    """Fault in every page of `array` (C-contiguous, fresh) by one `madvise(MADV_POPULATE_WRITE)`
    (Linux 5.14+), as the restore did before the thirteenth stop; True where the kernel did (the
    "small" and "block" ways: without it those pages are faulted in by the read, as the "fault"
    way's are)."""
    from hybridckpt.io import page_advice

    if page_advice._madvise is None or not array.flags.c_contiguous or not array.nbytes:
        return False
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    first = start // page_advice.PAGE_BYTES * page_advice.PAGE_BYTES
    last = -(-end // page_advice.PAGE_BYTES) * page_advice.PAGE_BYTES
    return page_advice._madvise(first, last - first, _MADV_POPULATE_WRITE) == 0


def back_memory(nbytes: int) -> bool:
    """Touch `nbytes` of fresh 4 KiB pages (`populate`) and give them back, then reset this
    process's peak RSS (`/proc/self/clear_refs`, Linux 4.0+: the peak a parent's `wait4` and
    `VmHWM` report counts from here): the memory a measured run then takes is memory the guest
    has just freed and the host still backs (module doc). True where the peak was reset (else
    the peak RSS includes these bytes: the caller says so)."""
    from hybridckpt.io import direct_io, page_advice

    if nbytes > 0:
        buf = direct_io.aligned_empty((nbytes,), "uint8")
        page_advice.no_huge_pages(buf)
        if not populate(buf):
            buf[::page_advice.PAGE_BYTES] = 0
        del buf
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


CHUNK_FILE = re.compile(r"^\d+(\.\d+)*$")  # a raw chunk file of our store: its grid position


def machine_seconds() -> dict[str, float]:
    """The whole machine's CPU seconds so far (`/proc/stat`, all CPUs): waiting on IO, taken by the
    hypervisor (steal), and spent by other processes' system and user time included; {} where
    there is no /proc/stat. A restore's round slower than the rest says here whether the disk or
    the host was busy."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    got = dict(zip(names, (int(x) / tick for x in fields), strict=False))
    return {k: got[k] for k in ("user", "system", "idle", "iowait", "steal") if k in got}


def chunk_files(ck: str) -> list[str]:
    """The chunk files of every step's params and opt_state of our store `ck` (what a restore of
    it reads)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(ck) for f in fs if CHUNK_FILE.match(f))


def files_bytes(paths: list[str]) -> int:
    """The bytes of `paths` together: what a run that reads them fills (`back_memory`)."""
    return sum(os.path.getsize(p) for p in paths)


def way_seconds(listed: str, threads: int, pages: str, direct: bool) -> float:
    """One way in a fresh process (`--_way`), in the restore's process state: its modules loaded first
    (`load_restore_modules`), its memory backed (`back_memory`), then `fresh_read` of the files
    listed in the JSON file `listed`. The backing's pages go back to the kernel (their mapping
    removed), so the reads still take the kernel's fault on each fresh page, as a restore's first
    arrays do; only the host's faults are spared, for every measured process alike."""
    out = subprocess.run([sys.executable, HERE, "--_way", listed, str(threads), pages, "direct" if direct else "cached"],
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def measured_round(paths: list[str], *, direct: bool, turn: int = 0, restore: Callable[[], dict] | None = None
                   ) -> tuple[dict | None, dict[tuple[int, str], float]]:
    """One round: every way of `FLOOR_THREADS` x `FLOOR_PAGES` and, given, `restore` (a callable
    that runs one restore in a fresh process), each prepared the same way first (`prepare`), in
    an order turned by `turn` (the restore first in round 0, second in round 1, ...): (the
    restore's result or None, seconds per (threads, pages)). The ways are recorded in
    `WAYS_SEEN`."""
    ways = [(t, p) for t in FLOOR_THREADS for p in FLOOR_PAGES]
    if restore is None:  # (the ways alone: turned by `turn`)
        k = turn % len(ways)
        order: list = ways[k:] + ways[:k]
    else:  # (the restore, None here, at place `turn` among the ways)
        k = turn % (len(ways) + 1)
        order = ways[:k] + [None] + ways[k:]
    seconds, got = {}, None
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="floor-files-") as f:
        json.dump(paths, f)
        f.flush()
        for way in order:
            prepare(paths, direct=direct)
            if way is None:
                got = restore()
            else:
                seconds[way] = way_seconds(f.name, *way, direct)
    seconds = {w: seconds[w] for w in ways}
    WAYS_SEEN.append({"direct": direct, "seconds": {f"{t} threads, {PAGE_LABELS[p]}": round(s, 3)
                                                    for (t, p), s in seconds.items()}})
    return got, seconds


def fastest(ways: dict[tuple[int, str], float]) -> float:
    """The strict floor of a round: its fastest way."""
    return min(ways.values())


def fastest_small(ways: dict[tuple[int, str], float]) -> float:
    """The 4 KiB-page floor of a round: its fastest way with the pages a restore's arrays are."""
    return min(s for (_, p), s in ways.items() if p in SMALL_PAGES)


def fresh_read_floor(paths: list[str]) -> float:
    """The strict floor of reading `paths` (page cache warm) into fresh memory: one round of ways
    without a restore."""
    return fastest(measured_round(paths, direct=False)[1])


def direct_fresh_floor(paths: list[str]) -> float:
    """The strict floor of reading `paths` with O_DIRECT (pages dropped) into fresh memory."""
    return fastest(measured_round(paths, direct=True)[1])


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--_way":
        listed, threads, pages, how = sys.argv[2:]
        load_restore_modules()
        with open(listed) as f:
            paths = json.load(f)
        back_memory(files_bytes(paths))
        print(fresh_read(paths, int(threads), pages, how == "direct")[0])
        return
    raise SystemExit("fresh_floors.py is run by restore_floor.py and import_sources_floor.py (--_way)")


if __name__ == "__main__":
    main()
