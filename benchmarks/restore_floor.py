"""Benchmark: a restore of our store onto another mesh against the read floor of the bytes it
needs, measured in the same run (issue 42).

    python benchmarks/restore_floor.py [--gib 0.25] [--repeat 3] [--dir DIR] [--tree BASE] [--hidden 1024]

`--tree BASE` (another checkout, e.g. `git archive BASE | tar -x -C PATH`) runs instead warm,
then cold, restores of this code and of BASE's hybridckpt alternating (`compare_trees`): a
same-run before/after of the restore's seconds, CPU seconds (and the system part), page faults
(`ru_minflt`), bytes read with O_DIRECT, `cut` copies and peak RSS, and the O_DIRECT reads'
queue (`_queue`: seconds before the first read, seconds with none in flight, mean in flight).

Writes an HF Llama folder (fp32 safetensors, trained-like values: `orbax_speed.write_hf`; hidden
size `--hidden`, SwiGLU 11/4 of it: 1024 by default, 2048 for 1B widths, whose chunk files are
4x larger: `orbax_speed.set_hf_width`) of about `--gib` GiB (a `--dir` holding one already is
reused as it is) and imports it once onto fsdp=2,tp=2 (8 simulated CPU devices, default flags:
raw chunk files, a CRC-32 per chunk). Then, `--repeat` rounds, the order of the two kinds of run
swapped each round:

- warm (page cache holds the chunk files, as after an import that read them back or a restore
  before): the floors are `cat` of exactly the chunk files the restore needs to /dev/null, and
  the same files read into fresh buffers all held to the end (the memory a restore's arrays are,
  faulted in, which `cat` never touches), each way of `fresh_floors` (1, 2 or 4 threads; 4 KiB
  pages populated first or faulted in by the read, or huge pages) in its own fresh process;
  the row is `hybridckpt.restore(ck, "fsdp=4", profile=True)` in a fresh process, from the call
  until every array is on its devices (JAX, Orbax and hybridckpt's modules loaded before it: the
  process's wall, with them, is reported beside it);
- cold (those files' pages dropped with `posix_fadvise(POSIX_FADV_DONTNEED)`, which needs no root
  and touches no other file): the floors are the same bytes read with `O_DIRECT` into one reused
  4 KiB-aligned 8 MiB buffer, file after file, and the same fresh-memory ways with O_DIRECT;
  the row the same restore after the pages are dropped again.

The restore and the fresh-memory ways of a kind run as one round (`fresh_floors.measured_round`):
each in its own process with the restore's modules loaded, each after the same preparation
(warm: the files read once; cold: their pages dropped), the restore's place among the ways turned
each round, so that no way takes memory the restore has just freed while the restore takes memory
idle for seconds (on a VM whose balloon reports free memory, the history of a page decides its
cost: `fresh_floors`). Each kind's rows are against the strict floor (the fastest way) and the
4 KiB-page floor (the fastest way with the pages a restore's arrays are).

After each kind's round, its peer runs, prepared alike: Orbax's own restore of the same store onto
the same shardings (`orbax_peer`: what a JAX user without hybridckpt runs; it checks no CRC-32).

fsdp=2,tp=2 -> fsdp=4 cuts every stored chunk in two (each device needs half the rows of two
chunks), the case where a CRC-checked read could read a chunk more than once. Prints per kind the
medians (also of the account's own wall time, which leaves out what precedes and follows
`timing.account`), the ratio to the floor, the bytes the restore read (`io.byte_source.count_reads`, in the
child) over the bytes of the chunk files, the peak RSS, and the account of the median run (the
`--profile` table, `io.timing`). Records: docs/benchmarks.md "Restore onto another mesh at the
read floor".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

import floors  # noqa: E402
import orbax_speed  # noqa: E402
from fresh_floors import (  # noqa: E402
    WAYS_SEEN,
    back_memory,
    chunk_files,
    direct_fresh_floor,
    drop_pages,
    fastest,
    fastest_small,
    files_bytes,
    fresh_read_floor,
    load_restore_modules,
    measured_round,
    prepare,
)
from orbax_peer import run_peer  # noqa: E402

IMPORT_MESH, RESTORE_MESH = "fsdp=2,tp=2", "fsdp=4"
BLOCK = 8 << 20


def direct_read_floor(paths: list[str]) -> float:
    """Seconds to read `paths` with O_DIRECT (bypassing the page cache) into aligned buffers,
    file after file; the unaligned tail of a file through the page cache."""
    from hybridckpt.io import direct_io

    buf = direct_io.aligned_empty((BLOCK,), "uint8")
    t0 = time.perf_counter()
    for p in paths:
        n = os.path.getsize(p)
        whole = n - n % direct_io.DIRECT_ALIGN
        fd = direct_io.open_direct(p, os.O_RDONLY)
        if fd is None:
            raise SystemExit(f"{p}: the filesystem refused O_DIRECT")
        try:
            done = 0
            while done < whole:
                want = min(BLOCK, whole - done)
                if os.preadv(fd, [memoryview(buf)[:want]], done) != want:
                    raise OSError(f"{p}: short read at {done}")
                done += want
        finally:
            os.close(fd)
        if n > whole:
            with open(p, "rb") as f:
                f.seek(whole)
                f.read()
    return time.perf_counter() - t0


FRESH_WARM = "pread into fresh buffers held, page cache warm (fastest way: 1/2/4 threads; 4 KiB pages populated or faulted by the read, or huge pages; a fresh process each)"
FRESH_COLD = "O_DIRECT reads into fresh buffers held (fastest way: 1/2/4 threads; 4 KiB pages populated or faulted by the read, or huge pages; a fresh process each)"
FRESH_WARM_SMALL = "pread into fresh buffers held, page cache warm, 4 KiB pages (fastest of 1/2/4 threads, populated first, faulted by the read, or populated a block before its read)"
FRESH_COLD_SMALL = "O_DIRECT reads into fresh buffers held, 4 KiB pages (fastest of 1/2/4 threads, populated first, faulted by the read, or populated a block before its read)"


def child(ck: str) -> dict:
    """One restore in this process: its seconds (modules loaded before), the process's wall,
    the bytes it read from chunk files, its peak RSS and its account."""
    t0 = time.perf_counter()
    load_restore_modules()
    back_memory(files_bytes(chunk_files(ck)))  # (as each floor way's: `fresh_floors.back_memory`)
    import jax

    import hybridckpt
    from hybridckpt.cli.output import peak_rss_gib  # VmHWM: ru_maxrss would carry the parent's peak
    from hybridckpt.io.byte_source import count_reads
    from hybridckpt.io.read_tally import tally

    reads = _watch_reads()
    t1, cpu, before = time.perf_counter(), _cpu_s(), resource.getrusage(resource.RUSAGE_SELF)
    with count_reads() as counter:
        _, r = hybridckpt.restore(ck, RESTORE_MESH, profile=True)
        jax.block_until_ready(r.params)
    job, cpu, after = time.perf_counter() - t1, _cpu_s() - cpu, resource.getrusage(resource.RUSAGE_SELF)
    placed = sum(a.nbytes for a in jax.tree.leaves(r.params))
    direct = sum(v for k, v in counter.items() if isinstance(k, tuple) and k[1] == "direct")  # (O_DIRECT)
    return {"job_s": job, "cpu_s": cpu, "sys_s": after.ru_stime - before.ru_stime,
            "faults": after.ru_minflt - before.ru_minflt, "wall_s": time.perf_counter() - t0, "read_bytes": tally(counter)[0],
            "direct_bytes": direct,
            "placed_bytes": placed, "peak_rss_mb": peak_rss_gib() * 1024,
            "queue": _queue(reads, t1), "profile": r.profile.to_json()}


def _watch_reads() -> list:
    """The (start, end) of every O_DIRECT read (`io.direct_read.read`) from now on, in a list."""
    import threading

    from hybridckpt.io import direct_read

    seen, lock, real = [], threading.Lock(), direct_read.read

    def read(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            with lock:
                seen.append((t0, time.perf_counter()))

    direct_read.read = read
    return seen


def _queue(reads: list, t1: float) -> dict:
    """The O_DIRECT reads' queue from the restore's start `t1`: seconds before the first read
    (the main thread's metadata and plan), seconds between the first read's start and the last's
    end with none in flight, and the mean number in flight over that span."""
    if not reads:
        return {}
    edges = sorted([(a, 1) for a, _ in reads] + [(b, -1) for _, b in reads])
    depth, last, idle, area = 0, edges[0][0], 0.0, 0.0
    for t, d in edges:
        idle += (t - last) if depth == 0 else 0.0
        area += depth * (t - last)
        depth, last = depth + d, t
    span = edges[-1][0] - edges[0][0]
    return {"first_read_s": round(edges[0][0] - t1, 3), "none_in_flight_s": round(idle, 3),
            "mean_in_flight": round(area / span, 2) if span else 0.0}


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(ck: str, tree: str | None = None) -> dict:
    """One restore in a fresh process: of this checkout, or of the hybridckpt of the checkout at
    `tree` (first on the path)."""
    env = None if tree is None else dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, HERE, "--_child", ck], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_trees(ck: str, files: list[str], tree: str, repeat: int) -> list[dict]:
    """Restores of this checkout and of `tree` (a base commit unpacked there: `git archive
    BASE | tar -x -C PATH`), warm and cold, alternating, the order turned each round, with the
    kind's floor measured before each pair (warm: the fresh-buffer floor; cold: the O_DIRECT
    floor, the chunk files' pages dropped before it and before each restore): a same-run
    before/after per kind (medians of the restore's seconds and of its CPU seconds, which a
    machine shared with other work disturbs less; the ratios are the figures, the seconds depend
    on the machine's load), with the bytes each read with O_DIRECT and its `cut` copies."""
    rows = []
    _child(ck, tree)  # (a warm-up of the other checkout's modules, not counted)
    for kind in ("warm", "cold"):
        runs: dict[str, list] = {"this": [], "tree": [], "floor": [], "fresh_floor": []}
        for i in range(repeat):
            if kind == "warm":
                floors.read_floor(files)
                runs["floor"].append(fresh_read_floor(files))
            else:
                drop_pages(files)
                runs["floor"].append(direct_read_floor(files))
                drop_pages(files)
                runs["fresh_floor"].append(direct_fresh_floor(files))
            for name in ("this", "tree") if i % 2 == 0 else ("tree", "this"):
                if kind == "cold":
                    drop_pages(files)
                runs[name].append(_child(ck, tree if name == "tree" else None))
        rows.append(_compared(kind, runs))
    return rows


def _compared(kind: str, runs: dict[str, list]) -> dict:
    med = {k: statistics.median(r["job_s"] if isinstance(r, dict) else r for r in v) for k, v in runs.items() if v}
    cpu = {k: statistics.median(r["cpu_s"] for r in runs[k]) for k in ("this", "tree")}
    row = {"kind": kind, "this_cpu_s": round(cpu["this"], 3), "tree_cpu_s": round(cpu["tree"], 3),
           "this_over_tree_cpu": round(cpu["this"] / cpu["tree"], 3),
           "sys_s": {k: round(statistics.median(r.get("sys_s", 0) for r in runs[k]), 3) for k in ("this", "tree")},
           "faults": {k: round(statistics.median(r.get("faults", 0) for r in runs[k])) for k in ("this", "tree")},
           "cpu_runs_s": {k: [round(r["cpu_s"], 3) for r in runs[k]] for k in ("this", "tree")},
           "peak_rss_mb": {k: round(max(r["peak_rss_mb"] for r in runs[k])) for k in ("this", "tree")},
           "this_s": round(med["this"], 3), "tree_s": round(med["tree"], 3), "floor_s": round(med["floor"], 3),
           "floor": FRESH_WARM if kind == "warm" else "O_DIRECT reads, pages dropped",
           "this_over_tree": round(med["this"] / med["tree"], 3),
           "this_over_floor": round(med["this"] / med["floor"], 2),
           "tree_over_floor": round(med["tree"] / med["floor"], 2),
           **({"fresh_floor_s": round(med["fresh_floor"], 3), "fresh_floor": FRESH_COLD,
               "this_over_fresh_floor": round(med["this"] / med["fresh_floor"], 2),
               "tree_over_fresh_floor": round(med["tree"] / med["fresh_floor"], 2)} if "fresh_floor" in med else {}),
           "direct_bytes": {k: [r.get("direct_bytes", 0) for r in runs[k]] for k in ("this", "tree")},
           "read_bytes": {k: [r["read_bytes"] for r in runs[k]] for k in ("this", "tree")},
           "this_cut_busy_s": [round(_stage(r, "cut").busy_s, 3) for r in runs["this"]],
           "tree_cut_busy_s": [round(_stage(r, "cut").busy_s, 3) for r in runs["tree"]],
           "this_cut_calls": [_stage(r, "cut").calls for r in runs["this"]],
           "tree_cut_calls": [_stage(r, "cut").calls for r in runs["tree"]],
           "this_checksum_calls": [_stage(r, "checksum").calls for r in runs["this"]],
           "queue": {k: _median_queue(runs[k]) for k in ("this", "tree")},
           "tree_checksum_calls": [_stage(r, "checksum").calls for r in runs["tree"]],
           "runs_s": {k: [round(r["job_s"] if isinstance(r, dict) else r, 3) for r in v] for k, v in runs.items()},
           "load_average": [round(x, 1) for x in os.getloadavg()]}
    print(json.dumps(row))
    return row


def _median_queue(runs: list[dict]) -> dict:
    """The median of each `_queue` figure over runs (O_DIRECT reads: warm restores have few)."""
    keys = sorted({k for r in runs for k in r.get("queue", {})})
    return {k: round(statistics.median(r["queue"][k] for r in runs if k in r.get("queue", {})), 3) for k in keys}


def _stage(run: dict, name: str):
    from hybridckpt.io.timing import Profile

    return Profile.from_json(run["profile"]).stage(name)


def report(kind: str, runs: list[dict], floor_runs: list[float], floor_name: str, stored: int) -> dict:
    from hybridckpt.cli.profile import profile_lines
    from hybridckpt.io.timing import Profile

    med = sorted(runs, key=lambda r: r["job_s"])[len(runs) // 2]
    job, floor = statistics.median(r["job_s"] for r in runs), statistics.median(floor_runs)
    row = {
        "kind": kind,
        "restore_s": round(job, 3),
        "floor": floor_name,
        "floor_s": round(floor, 3),
        "over_floor": round(job / floor, 2),
        "account_wall_s": round(statistics.median(Profile.from_json(r["profile"]).wall_s for r in runs), 3),
        "process_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
        "read_over_stored": round(med["read_bytes"] / stored, 4),
        "placed_bytes": med["placed_bytes"],
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs)),
        "queue": _median_queue(runs),
        "restore_runs_s": [round(r["job_s"], 3) for r in runs],
        "floor_runs_s": [round(f, 3) for f in floor_runs],
    }
    print(f"\n== restore onto {RESTORE_MESH}, {kind}: account of the median run ==")
    print("\n".join(profile_lines(Profile.from_json(med["profile"]))))
    print(json.dumps(row))
    return row


PEER = ("Orbax's own restore (CheckpointManager + StandardRestore onto the same targets: TensorStore's reads, "
        "no CRC-32 check; a fresh process each, prepared alike)")


def peer_row(kind: str, ours: list[dict], peer: list[dict]) -> dict:
    """Our restore against Orbax's restore of the same store onto the same shardings, the same
    rounds: medians of seconds and CPU seconds, highest peak RSS."""
    med = {k: statistics.median(r["job_s"] for r in v) for k, v in (("ours", ours), ("peer", peer))}
    row = {"kind": kind, "peer": PEER, "restore_s": round(med["ours"], 3), "peer_s": round(med["peer"], 3),
           "peer_over_restore": round(med["peer"] / med["ours"], 2),
           "restore_cpu_s": round(statistics.median(r["cpu_s"] for r in ours), 3),
           "peer_cpu_s": round(statistics.median(r["cpu_s"] for r in peer), 3),
           "restore_peak_rss_mb": round(max(r["peak_rss_mb"] for r in ours)),
           "peer_peak_rss_mb": round(max(r["peak_rss_mb"] for r in peer)),
           "peer_runs_s": [round(r["job_s"], 3) for r in peer]}
    print(json.dumps(row))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--tree", default=None, help="a base checkout to compare with (warm restores, alternating)")
    ap.add_argument("--hidden", type=int, default=orbax_speed.HF_DIM, help="the model's hidden size (SwiGLU 11/4 of it)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        print(json.dumps(child(a._child)))
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    floors.cached_bytecode(base)
    src, ck = os.path.join(base, "hf_src"), os.path.join(base, "orbax")
    try:
        if not os.path.isdir(src):
            orbax_speed.set_hf_width(a.hidden)
            subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "orbax_speed.py"), "--_write", "hf",
                            src, str(orbax_speed.hf_layers(a.gib)), "--_hf_hidden", str(a.hidden)], check=True)
        if not os.path.isdir(ck):
            subprocess.run([sys.executable, "-m", "hybridckpt.cli", "import", src, ck, "--mesh", IMPORT_MESH,
                            "--quiet"], check=True, env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                                                             JAX_PLATFORMS="cpu"))
        files = chunk_files(ck)
        stored = sum(os.path.getsize(p) for p in files)
        if a.tree:
            compare_trees(ck, files, a.tree, a.repeat)
            return
        runs: dict[str, list] = {k: [] for k in ("warm", "cold", "warm_floor", "fresh_floor", "cold_floor",
                                                 "cold_fresh_floor", "small_floor", "cold_small_floor",
                                                 "warm_peer", "cold_peer")}
        _child(ck)  # a warm-up, not counted: the modules' files cached
        for i in range(a.repeat):
            for kind in ("warm", "cold") if i % 2 == 0 else ("cold", "warm"):
                if kind == "warm":
                    floors.read_floor(files)  # (pages in)
                    runs["warm_floor"].append(floors.read_floor(files))
                else:
                    drop_pages(files)
                    runs["cold_floor"].append(direct_read_floor(files))
                # the restore among the fresh-memory ways, each prepared alike, its place turned each round
                got, ways = measured_round(files, direct=kind == "cold", turn=i, restore=lambda: _child(ck))
                runs[kind].append(got)
                runs["fresh_floor" if kind == "warm" else "cold_fresh_floor"].append(fastest(ways))
                runs["small_floor" if kind == "warm" else "cold_small_floor"].append(fastest_small(ways))
                prepare(files, direct=kind == "cold")  # the peer: Orbax's own restore, prepared alike
                runs[f"{kind}_peer"].append(run_peer(ck, RESTORE_MESH))
        print(f"{len(files)} chunk files, {stored / 1e6:.0f} MB; {os.cpu_count()} CPUs; load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        rows = [report("warm", runs["warm"], runs["warm_floor"], "cat to /dev/null, page cache warm", stored),
                report("warm", runs["warm"], runs["fresh_floor"], FRESH_WARM, stored),
                report("cold", runs["cold"], runs["cold_floor"], "O_DIRECT reads, pages dropped", stored),
                report("cold", runs["cold"], runs["cold_fresh_floor"], FRESH_COLD, stored),
                report("warm", runs["warm"], runs["small_floor"], FRESH_WARM_SMALL, stored),
                report("cold", runs["cold"], runs["cold_small_floor"], FRESH_COLD_SMALL, stored)]
        peers = [peer_row(kind, runs[kind], runs[f"{kind}_peer"]) for kind in ("warm", "cold")]
        print(json.dumps({"gib": a.gib, "repeat": a.repeat, "stored_bytes": stored, "rows": rows, "peers": peers,
                          "fresh_floor_ways": WAYS_SEEN}, indent=1))
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
