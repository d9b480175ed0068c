"""(h) Metadata at the size of real runs: reading what is where in a 405B checkpoint of many ranks.

A sparse DCP checkpoint shaped like Llama 3.1 405B trained with FSDP2 (model + AdamW moments +
step: 4548 tensors, `benchmarks/scale_dcp.py`: torch's own metadata objects, pickled by torch's
`FileSystemWriter.finish`, byte-identical to what its planner path writes; the `.distcp` files
sparse) at each `--ranks` (`--format torch_dist`: a Megatron-Core torch_dist save of the same
model, TP 8 x PP 9 x DP, ranks a multiple of 72, `benchmarks/scale_torch_dist.py`); on it, each in a fresh
process, alternating, `--repeats` times:

- torch: `FileSystemReader(path).read_metadata()` (torch's own metadata read, the least a
  torch-based loader does before reading a byte);
- after: `hybridckpt inspect PATH` of this tree (the whole command: metadata, checks of every
  chunk, the files' sizes, the family's names, the printed summary), the modules it imports
  (the CLI's, every reader's) imported before the timer as torch's are, and timed apart
  (`imports` in the JSON, the last column of the table);
- before: the same command from another source tree (`--before DIR`, e.g. `git archive` of main
  unpacked there; skipped when not given; `--before-repeats` runs, 1 by default: it is slow).

Each row: the median wall time of the timed call in the process (imports excluded) and the median
peak RSS of the process (`ru_maxrss`, imports included), and the ratios to torch's medians of
the same run. `--json FILE` writes every sample.

    python benchmarks/scale_metadata.py --root /tmp/scale [--ranks 64 256 1024] [--repeats 3]
                                        [--before /tmp/main_tree] [--before-repeats 1] [--json F]
                                        [--holes-above 64] [--plan-ranks 64 --plan-mesh fsdp=64
                                         --plan-processes 64]

`--plan-ranks R`: also, in fresh processes, the plan of one host out of `--plan-processes` for
an import of the R-rank source onto `--plan-mesh` (`inspect --plan --processes N --process 0`,
the mesh's devices simulated on the CPU): time, peak RSS, the bytes that host reads (its share of
the arrays, plus the torch.save headers of the chunks it reads) and writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)

_CHILD = r"""
import io, json, os, resource, sys, time, contextlib
kind, path = sys.argv[1], sys.argv[2]
if kind == "torch":
    from torch.distributed.checkpoint import FileSystemReader
    t0 = time.perf_counter()
    md = FileSystemReader(path).read_metadata()
    n = sum(len(getattr(e, "chunks", ())) for e in md.state_dict_metadata.values())
    imports = None
else:
    t0 = time.perf_counter()
    from hybridckpt.cli import main
    import hybridckpt.cli.parser, hybridckpt.jobs.inspect  # what main imports on the way
    from hybridckpt.formats import registry
    for f in registry.READABLE:  # every reader module (`detect` tries them in order): imports, as torch's are
        f.reader
    imports = time.perf_counter() - t0
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = main(["inspect", path])
    assert rc == 0, out.getvalue()[-2000:]
    n = None
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": dt, "peak_rss": rss, "chunks": n, "imports": imports}))
"""


def run_one(kind: str, path: str, before: str | None) -> dict:
    """One fresh process: `kind` (torch / after / before) on the checkpoint at `path`."""
    env = dict(os.environ)
    if kind == "before":
        env["PYTHONPATH"] = before + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    p = subprocess.run([sys.executable, "-c", _CHILD, "torch" if kind == "torch" else "inspect", path],
                       env=env, capture_output=True, text=True, cwd="/", check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} on {path} failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


TD_TP, TD_PP = 8, 9  # the torch_dist sources' model parallelism (NeMo 2's llama31_405b recipe)


def source_torch_dist(root: str, ranks: int, log, holes_above: int = 64) -> tuple[str, dict]:
    """The Megatron-Core torch_dist checkpoint of `ranks` = 8 x 9 x DP ranks under `root`
    (`scale_torch_dist`: the `.metadata` megatron-core 0.19.2 writes, byte-identical at the real
    case's size), written once in its own process; returns its iter folder (what torch reads)."""
    if ranks % (TD_TP * TD_PP):
        raise ValueError(f"torch_dist sources have {TD_TP} x {TD_PP} x DP ranks, not {ranks}")
    path = os.path.join(root, f"megatron405b_{ranks}")
    info_path = os.path.join(path, "scale_source.json")
    if not os.path.isfile(info_path):
        log(f"writing the {ranks}-rank torch_dist source at {path}")
        subprocess.run([sys.executable, os.path.join(HERE, "scale_torch_dist.py"), path, "--tp", str(TD_TP),
                        "--pp", str(TD_PP), "--dp", str(ranks // (TD_TP * TD_PP))]
                       + (["--holes"] if ranks > holes_above else []), check=True, stdout=subprocess.DEVNULL)
    with open(info_path) as f:
        return os.path.join(path, "iter_0000001"), json.load(f)


def source(root: str, ranks: int, log, holes_above: int = 64, fmt: str = "dcp") -> tuple[str, dict]:
    """The checkpoint of `ranks` ranks under `root` (written once, then reused): `scale_dcp`'s
    direct build of the `.metadata` torch's planner writes (byte-identical, `scale_dcp.check`);
    the tensors' archive headers written up to `holes_above` ranks (a plan reads them), holes
    above (no figure here reads a tensor byte; 5 KiB of disk a chunk saved)."""
    if fmt == "torch_dist":
        return source_torch_dist(root, ranks, log, holes_above)
    path = os.path.join(root, f"llama405b_{ranks}")
    info_path = os.path.join(path, "scale_source.json")
    if not os.path.isfile(info_path):
        log(f"writing the {ranks}-rank source at {path}")
        # in its own process: a child's peak RSS starts from its parent's RSS at the fork (Linux
        # keeps the high-water mark across exec), so the measuring process must stay small
        subprocess.run([sys.executable, os.path.join(HERE, "scale_dcp.py"), path, "--ranks", str(ranks)]
                       + (["--holes"] if ranks > holes_above else []), check=True, stdout=subprocess.DEVNULL)
    with open(info_path) as f:
        return path, json.load(f)


_PLAN_CHILD = r"""
import io, json, os, resource, sys, time, contextlib
path, mesh, processes = sys.argv[1], sys.argv[2], int(sys.argv[3])
from hybridckpt.jobs.plan_report import plan_import
t0, c0 = time.perf_counter(), time.process_time()
plan = plan_import(path, mesh=mesh, process=0, processes=processes)
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
p = plan.processes[0]
print(json.dumps({"seconds": dt, "cpu": cpu, "peak_rss": rss, "bytes_read": p.bytes_read, "reads": p.reads,
                  "files": len(p.files), "bytes_written": p.bytes_written, "tiles": p.tiles,
                  "devices": len(plan.devices), "tensor_bytes": plan.tensor_bytes, "mesh": plan.mesh}))
"""


def plan_one(path: str, mesh: str, processes: int, tree: str | None = None) -> dict:
    """One fresh process: the plan of process 0 of `processes` importing `path` onto `mesh`
    (`hybridckpt inspect PATH --plan --mesh M --processes N --process 0`), on as many simulated
    CPU devices as the mesh has; by the source tree `tree` (PYTHONPATH) if given."""
    from math import prod

    n = prod(int(x.split("=")[1]) for x in mesh.split(","))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _PLAN_CHILD, path, mesh, str(processes)], env=env,
                       capture_output=True, text=True, cwd="/", check=False)
    if p.returncode != 0:
        raise RuntimeError(f"plan of {path} failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def compile_trees(*trees: str) -> None:
    """Byte-compile the package of each source tree (`hybridckpt/`, `models/`), as `pip install`
    does: the timed call imports the modules `inspect` needs, and where PYTHONDONTWRITEBYTECODE is
    set (this machine) an uncompiled tree is compiled again in every process (~0.3 s of ~170
    modules), which torch, installed compiled, never pays."""
    import compileall

    for tree in trees:
        for sub in ("hybridckpt", "models"):
            if os.path.isdir(os.path.join(tree, sub)):
                compileall.compile_dir(os.path.join(tree, sub), quiet=1)


def measure(root: str, ranks_list, repeats: int, log, *, before: str | None = None, before_repeats: int = 1,
            holes_above: int = 64, samples: dict | None = None, fmt: str = "dcp") -> list[tuple[int, dict, dict]]:
    """For each rank count: (ranks, the source's info, {kind: (median seconds, median peak RSS)}),
    torch's `read_metadata` against `hybridckpt inspect` (and `before`), fresh processes, alternating;
    the source trees byte-compiled first (`compile_trees`)."""
    kinds = ["torch", "after"] + (["before"] if before else [])
    compile_trees(TREE, *([before] if before else []))
    samples = {} if samples is None else samples
    rows = []
    for ranks in ranks_list:
        path, info = source(root, ranks, log, holes_above, fmt)
        got = {k: [] for k in kinds}
        for i in range(repeats):
            for k in kinds if i % 2 == 0 else kinds[::-1]:  # alternate the order
                if k == "before" and i >= before_repeats:
                    continue
                t0 = time.perf_counter()
                got[k].append(run_one(k, path, before))
                log(f"  {ranks} ranks {k}: {got[k][-1]['seconds']:.1f} s, "
                    f"{got[k][-1]['peak_rss'] / 2**30:.2f} GiB ({time.perf_counter() - t0:.0f} s with imports)")
        samples[ranks] = {"source": info, "runs": got}
        med = {k: (statistics.median(r["seconds"] for r in v), statistics.median(r["peak_rss"] for r in v),
                   statistics.median(r.get("imports") or 0.0 for r in v))
               for k, v in got.items()}
        rows.append((ranks, info, med))
    return rows


def _table(rows, kinds, repeats: int, before_repeats: int) -> None:
    print("| ranks | chunks | `.metadata` | " + " | ".join(
        {"torch": "torch `read_metadata`", "after": "`hybridckpt inspect`", "before": "`inspect` before"}[k]
        for k in kinds) + " | after / torch (time, memory) | after's imports |")
    print("|---" * (5 + len(kinds)) + "|")
    for ranks, info, med in rows:
        cells = [f"{med[k][0]:.1f} s, {med[k][1] / 2**30:.2f} GiB" for k in kinds]
        ratio = f"{med['after'][0] / med['torch'][0]:.2f}x, {med['after'][1] / med['torch'][1]:.2f}x"
        print(f"| {ranks} | {info['chunks'] / 1000:.0f}k | {info['metadata_bytes'] / 2**20:.0f} MiB | "
              + " | ".join(cells) + f" | {ratio} | {med['after'][2]:.2f} s |")
    print(f"(medians of {repeats} fresh processes each ({before_repeats} for before), alternating; time: "
          "the timed call, imports excluded (ours timed apart: the last column); memory: the process's peak "
          "RSS, imports included)")


def measure_plan(root: str, ranks: int, mesh: str, processes: int, repeats: int, log, holes_above: int = 64,
                 before: str | None = None) -> dict:
    """The plan of process 0 of `processes` importing the `ranks`-rank source onto `mesh`, `repeats`
    fresh processes (alternating with the tree `before` if given): {"source", "runs", "seconds"
    (median), "peak_rss" (median), "mesh", "processes"} and "before": the same of `before`'s runs."""
    path, info = source(root, ranks, log, holes_above)
    runs, old = [], []
    for _ in range(repeats):
        runs.append(plan_one(path, mesh, processes))
        log(f"  plan of process 0 of {processes}: {runs[-1]['seconds']:.1f} s, {runs[-1]['peak_rss'] / 2**30:.2f} GiB")
        if before:
            old.append(plan_one(path, mesh, processes, before))
            log(f"  before: {old[-1]['seconds']:.1f} s, {old[-1]['peak_rss'] / 2**30:.2f} GiB")

    def med(xs):
        return {"runs": xs, "seconds": statistics.median(x["seconds"] for x in xs),
                "peak_rss": statistics.median(x["peak_rss"] for x in xs)}

    return {"source": info, "mesh": mesh, "processes": processes, "ranks": ranks, **med(runs),
            **({"before": med(old)} if before else {})}


def plan_line(pl: dict) -> str:
    r, info, n = pl["runs"][0], pl["source"], pl["processes"]
    return (f"Plan of process 0 of {n} ({r['devices']} of the {pl['mesh']} mesh's devices) importing the "
            f"{pl['ranks']}-rank source ({info['chunks'] / 1000:.0f}k chunks, {r['tensor_bytes'] / 2**40:.2f} TiB of "
            f"arrays): {pl['seconds']:.1f} s, {pl['peak_rss'] / 2**30:.2f} GiB peak RSS (medians of {len(pl['runs'])}); "
            f"reads {r['bytes_read'] / 2**30:.2f} GiB in {r['reads']} reads from {r['files']} files = "
            f"{r['bytes_read'] / r['tensor_bytes']:.5f} of the arrays (1/{n} = {1 / n:.5f}); writes "
            f"{r['bytes_written'] / 2**30:.2f} GiB ({r['bytes_written'] / r['tensor_bytes']:.5f}) in {r['tiles']} tiles"
            + (f"; before: {pl['before']['seconds']:.1f} s, {pl['before']['peak_rss'] / 2**30:.2f} GiB, "
               f"{pl['before']['runs'][0]['reads']} reads in {pl['before']['runs'][0]['tiles']} tiles" if "before" in pl else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="where the sparse sources are (written if absent)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", help="a source tree of the version to compare with (PYTHONPATH)")
    ap.add_argument("--before-repeats", type=int, default=1, help="runs of `before` (it is the slow one)")
    ap.add_argument("--json", help="write every sample here")
    ap.add_argument("--format", default="dcp", choices=("dcp", "torch_dist"),
                    help="dcp: FSDP2 (scale_dcp); torch_dist: Megatron-Core TP 8 x PP 9 x DP (scale_torch_dist)")
    ap.add_argument("--holes-above", type=int, default=64,
                    help="sources of more ranks leave the tensors' archive headers out (holes; default 64)")
    ap.add_argument("--plan-ranks", type=int, default=0,
                    help="also plan one host's share of an import of this source (0: no plan)")
    ap.add_argument("--plan-mesh", default="fsdp=64", help="the import's mesh (simulated CPU devices)")
    ap.add_argument("--plan-processes", type=int, default=64, help="processes (hosts) the mesh's devices split over")
    a = ap.parse_args(argv)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    kinds = ["torch", "after"] + (["before"] if a.before else [])
    samples: dict = {}
    rows = measure(a.root, a.ranks, a.repeats, log, before=a.before, before_repeats=a.before_repeats,
                   holes_above=a.holes_above, samples=samples, fmt=a.format)
    _table(rows, kinds, a.repeats, a.before_repeats)
    if len(rows) > 1:
        (r0, i0, m0), (r1, i1, m1) = rows[0], rows[-1]
        print(f"\nGrowth from {r0} to {r1} ranks ({i1['chunks'] / i0['chunks']:.1f}x the chunks, "
              f"{i1['metadata_bytes'] / i0['metadata_bytes']:.1f}x the `.metadata`): "
              + "; ".join(f"{k} {m1[k][0] / m0[k][0]:.1f}x the time, {m1[k][1] / m0[k][1]:.1f}x the memory"
                          for k in kinds))
    if a.plan_ranks:
        pl = measure_plan(a.root, a.plan_ranks, a.plan_mesh, a.plan_processes, a.repeats, log, a.holes_above,
                          a.before)
        samples["plan"] = pl
        print("\n" + plan_line(pl))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
