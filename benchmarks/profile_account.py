"""Benchmark: the account of the time (issue 42) of an import, a restore and an export, and what
keeping it costs.

    python benchmarks/profile_account.py [--gib 1] [--repeat 3] [--dir DIR]

Writes an HF Llama folder (fp32 safetensors shards, trained-like weights: `orbax_speed.write_hf`)
of about `--gib` GiB, then, each job in its own process (bytecode cached), alternating:

- `import` onto fsdp=2,tp=2 (8 simulated CPU devices), with `profile=True` and without;
- `restore` of the result onto fsdp=4 (`hybridckpt.restore(..., profile=True)`), every array
  blocked on;
- `export` of the result back to HF safetensors, with `profile=True` and without.

Prints, per job, the account of its median profiled run (the `--profile` table:
`hybridckpt.cli.profile`), whether its shares and other/waiting sum to its wall time (they do by
construction: `io.timing`) and how much of that wall time the job's own `seconds` covers (the
rest: Python's module imports before the job's clock starts, in the stage "start"); then the
overhead of the account: the ratio of the medians of the profiled and unprofiled runs' own
seconds (noise on a loaded machine: read it with the next figure), and the estimate calls x cost per call / wall
time, from the stage count of the profiled run and the measured cost of one stage entered and
left with an account open (`per_stage_us`); the import runs once first, uncounted (a warm-up).
Records: docs/benchmarks.md "The account of the time".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

import floors  # noqa: E402
from orbax_speed import hf_layers  # noqa: E402

IMPORT_MESH, RESTORE_MESH = "fsdp=2,tp=2", "fsdp=4"


def _devices() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"


def child(kind: str, src: str, dst: str, profile: str) -> dict:
    """One job in this process: its wall time (from before its modules load), its own seconds,
    its account (JSON) when `profile` is "1"."""
    _devices()
    on = profile == "1"
    t0 = time.perf_counter()
    if kind == "import":
        from hybridckpt.jobs.import_ import import_checkpoint

        s = import_checkpoint(src, dst, mesh=IMPORT_MESH, overwrite=True, profile=on)
        job_s, prof = s.seconds, s.profile
    elif kind == "export":
        from hybridckpt.jobs.export import export_checkpoint

        s = export_checkpoint(src, dst, overwrite=True, profile=on)
        job_s, prof = s.seconds, s.profile
    else:
        import jax

        from hybridckpt.jobs.restore import restore

        t1 = time.perf_counter()  # (the restore has no seconds of its own: from here, modules loaded)
        _, r = restore(src, RESTORE_MESH, profile=on)
        jax.block_until_ready(r.params)
        job_s, prof = time.perf_counter() - t1, r.profile
    return {"wall_s": time.perf_counter() - t0, "job_s": job_s, "profile": prof.to_json() if prof else None}


def per_stage_us(n: int = 100_000) -> float:
    """Microseconds one stage costs, entered and left with an account open (the median of 5)."""
    from hybridckpt.io import timing

    runs = []
    with timing.account():
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                with timing.stage("write", 1):
                    pass
            runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def _child(*argv: str) -> dict:
    if argv[0] != "restore":  # a fresh destination: the job's row holds no deletion of the last one's
        shutil.rmtree(argv[2], ignore_errors=True)
    out = subprocess.run([sys.executable, HERE, "--_child", *argv], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(name: str, runs_on: list[dict], runs_off: list[dict], cost_us: float) -> dict:
    from hybridckpt.cli.profile import profile_lines
    from hybridckpt.io.timing import Profile

    median_on = sorted(runs_on, key=lambda r: r["wall_s"])[len(runs_on) // 2]
    p = Profile.from_json(median_on["profile"])
    shares = sum(s.share_s for s in p.stages)
    calls = sum(s.calls for s in p.stages)
    row = {
        "job": name,
        "wall_s": round(p.wall_s, 3),
        "sum_of_shares_and_other_over_wall": round((shares + p.other_s) / p.wall_s, 6),
        "other_over_wall": round(p.other_s / p.wall_s, 4),
        "job_seconds_over_wall": round(median_on["job_s"] / p.wall_s, 4),
        "stage_calls": calls,
        "estimated_overhead": round(calls * cost_us * 1e-6 / p.wall_s, 5),
    }
    if runs_off:
        row["profiled_over_unprofiled"] = round(statistics.median(r["job_s"] for r in runs_on)
                                                / statistics.median(r["job_s"] for r in runs_off), 3)
    print(f"\n== {name}: account of the median profiled run ==")
    print("\n".join(profile_lines(p)))
    print(json.dumps(row))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        print(json.dumps(child(*a._child)))
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    floors.cached_bytecode(base)
    src, ck, out = (os.path.join(base, n) for n in ("hf_src", "orbax", "hf_out"))
    try:
        subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "orbax_speed.py"), "--_write", "hf",
                        src, str(hf_layers(a.gib))], check=True)
        runs: dict[str, list] = {k: [] for k in ("import_on", "import_off", "restore_on", "export_on", "export_off")}
        _child("import", src, ck, "0")  # a warm-up, not counted: the modules' and the source's files cached
        for i in range(a.repeat):  # alternating, either one first in turn: a slower minute hits both
            for profile in ("1", "0") if i % 2 == 0 else ("0", "1"):
                runs[f"import_{'on' if profile == '1' else 'off'}"].append(_child("import", src, ck, profile))
            runs["restore_on"].append(_child("restore", ck, "-", "1"))
            for profile in ("1", "0") if i % 2 == 0 else ("0", "1"):
                runs[f"export_{'on' if profile == '1' else 'off'}"].append(_child("export", ck, out, profile))
        cost = per_stage_us()
        print(f"one stage entered and left with an account open: {cost:.2f} us")
        rows = [report("import", runs["import_on"], runs["import_off"], cost),
                report("restore", runs["restore_on"], [], cost),
                report("export", runs["export_on"], runs["export_off"], cost)]
        print(json.dumps({"gib": a.gib, "repeat": a.repeat, "per_stage_us": round(cost, 3), "rows": rows}, indent=1))
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
