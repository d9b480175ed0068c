"""Benchmark (issue 42, "import at the floor"): an FSDP2 DCP run with AdamW imported, against the
O_DIRECT write floor of the bytes the import writes, with the per-stage account.

    python benchmarks/import_dcp_floor.py [--gib 1.0] [--repeat 3] [--mesh fsdp=4] [--dir DIR]

The source: the Llama shapes of `consolidate_dcp` (hidden 2048, SwiGLU 5632, vocab 8192, fp32),
layers chosen so params + AdamW's two moments are about `--gib` GiB, saved by 2 gloo processes
with `torch.distributed.checkpoint.save` as FSDP2 does (every param and moment a DTensor sharded
on dim 0 over the 2 ranks, `step` per param, `param_groups` with lr/betas/eps/weight_decay, fqn
keys as `get_state_dict` gives them). Then, each job in its own process (bytecode cached, page
cache warm), `repeat` times: `import_checkpoint(SRC, CK, mesh=--mesh, config=config.json,
profile=True)` on 8 simulated CPU devices (default flags: raw chunks, O_DIRECT, CRC-32s). The
floors (`floors.measure`: best of 2) are measured in the same run, before and after the imports,
over the bytes the import writes (its `bytes`). Prints each run's wall, the median's account
(`--profile` table), and the ratio median / O_DIRECT floor; `--json` for the rows only. Three
ratios: `job_over_floor` (the job's own seconds, which leave out the modules its first job
loads), `wall_over_floor` (from before the child's hybridckpt and JAX imports to the end of the
import) and `process_over_floor` (the child process from its start to its exit, timed by the
parent: what a user timing `hybridckpt import` sees).
`--compare VARIANT` (repeatable) also runs, alternating with the default, imports with issue 42's
read changes undone: "gap=0" (`ByteSource.read_runs` makes a pread a run), "nojoin" (each shard
box read apart: `store.stream.joined_boxes` off), "nojoin,gap=0" (both: as before issue 42), "fsync"
(an fsync per chunk file instead of one syncfs per item, `io.writeback.FilesystemSync`).
`--tree NAME=PATH` (repeatable) also runs, alternating, the imports of another checkout's code (a
base commit unpacked at PATH): a same-run before/after. Each run also reports its CPU seconds
(user + system of the child process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

import floors  # noqa: E402
from consolidate_dcp import FFN, HIDDEN, VOCAB, hf_config, shapes  # noqa: E402


def layers_for(gib: float) -> int:
    """Layers whose params and two fp32 moments are about `gib` GiB (at least 1)."""
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN) * 4 * 3
    rest = gib * 2**30 - 2 * VOCAB * HIDDEN * 4 * 3
    return max(1, round(rest / per_layer))


def _writer(rank: int, out: str, layers: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(2000 + rank)
    model, state = {}, {}
    for name, shape in shapes(layers).items():
        local = (shape[0] // 2, *shape[1:])

        def dt(t):
            return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)

        model[name] = dt(torch.randn(*local, generator=g) * 0.02)
        state[name] = {"step": torch.tensor(7.0), "exp_avg": dt(torch.randn(*local, generator=g) * 1e-3),
                       "exp_avg_sq": dt(torch.rand(*local, generator=g) * 1e-6)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
               "fused": None, "params": list(model)}]
    dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def write(out: str, layers: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_writer, args=(out, layers, port), nprocs=2, start_method="fork")


def child(src: str, dst: str, cfg: str, mesh: str, variant: str) -> dict:
    """One import in this process: wall (from before its modules load), its seconds, bytes,
    account. `variant`: "-" (as shipped), or comma-separated undoings of issue 42's read changes:
    "gap=N" (`io.read_batches.GAP_PER_CALL_BYTES` = N; 0: a pread a run), "nojoin" (each shard box
    read apart, `store.stream.joined_boxes` not joining them)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    from hybridckpt.io import read_batches
    from hybridckpt.jobs.import_ import import_checkpoint
    from hybridckpt.store import stream

    for v in variant.split(","):
        if v == "fsync":  # issue 42's one syncfs an item undone: an fsync per chunk file (and .zarray)
            from hybridckpt.io import writeback

            writeback.FilesystemSync.open = classmethod(lambda cls, folder: None)
        elif v.startswith("gap="):
            read_batches.GAP_PER_CALL_BYTES = int(v[4:])
        elif v == "nojoin":
            stream.joined_boxes = sorted
    from hybridckpt.io import heap

    heap.share_arenas()  # as `hybridckpt import` does before its job (`io.heap`)
    s = import_checkpoint(src, dst, mesh=mesh, config=cfg, overwrite=True, profile=True)
    from hybridckpt.cli.output import peak_rss_gib  # VmHWM: ru_maxrss would carry the parent's peak

    return {"wall_s": time.perf_counter() - t0, "job_s": s.seconds, "bytes": s.bytes, "tensors": s.tensors,
            "peak_rss_mib": peak_rss_gib() * 1024,
            "profile": s.profile.to_json()}


def _child(src: str, dst: str, cfg: str, mesh: str, variant: str = "-", trees: dict | None = None) -> dict:
    """One import in a fresh process; a variant "tree:NAME" runs the hybridckpt of the checkout
    `trees[NAME]` (its own copy of this script, PYTHONPATH at it). Adds the child's CPU seconds."""
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    script, env = HERE, None
    if variant.startswith("tree:"):
        root = os.path.abspath((trees or {})[variant[5:]])
        script = os.path.join(root, "benchmarks", os.path.basename(HERE))
        env = dict(os.environ, PYTHONPATH=root)
        variant = "-"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run([sys.executable, script, "--_child", src, dst, cfg, mesh, variant], check=True,
                         capture_output=True, text=True, env=env)
    process_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["cpu_s"] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    row["process_s"] = process_s  # the child process from its start to its exit: what a user timing the command sees
    return row


def _busy(run: dict, stage: str) -> float:
    """Seconds of `stage` summed over the workers of a run's account."""
    from hybridckpt.io.timing import Profile

    return sum(s.busy_s for s in Profile.from_json(run["profile"]).stages if s.stage == stage)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mesh", default="fsdp=4")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", action="append", default=[],
                    help='also run, alternating, this variant ("gap=0", "nojoin", "nojoin,gap=0", "fsync": see `child`)')
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="also run, alternating, imports by the hybridckpt of another checkout (e.g. `git archive "
                         "BASE | tar -x -C PATH`): a same-run before/after")
    ap.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--_write", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        print(json.dumps(child(*a._child)))
        return
    if a._write:
        write(a._write[0], int(a._write[1]))
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    floors.cached_bytecode(base)
    src, ck, cfg = (os.path.join(base, n) for n in ("dcp", "orbax", "config.json"))
    try:
        layers = layers_for(a.gib)
        if not os.path.isdir(src):
            with open(cfg, "w") as f:
                json.dump(hf_config(layers), f)
            subprocess.run([sys.executable, HERE, "--_write", src, str(layers)], check=True, capture_output=True)
        paths = floors.files_under(src)
        first = _child(src, ck, cfg, a.mesh)  # a warm-up, not counted; says the bytes written
        fl = floors.measure(paths, os.path.join(base, "floor"), write_bytes=first["bytes"])
        trees = dict(t.split("=", 1) for t in a.tree)
        variants = ["-", *a.compare, *(f"tree:{n}" for n in trees)]
        by: dict[str, list] = {v: [] for v in variants}
        for i in range(a.repeat):  # alternating, the order turned each time: a slower minute hits all
            for v in variants if i % 2 == 0 else variants[::-1]:
                by[v].append(_child(src, ck, cfg, a.mesh, v, trees))
        runs = by["-"]
        fl2 = floors.measure(paths, os.path.join(base, "floor"), write_bytes=first["bytes"])
        floor_s = min(x for x in (fl["write_direct_s"], fl2["write_direct_s"]) if x is not None)
        med = sorted(runs, key=lambda r: r["job_s"])[len(runs) // 2]
        row = {
            "gib_source": round(sum(os.path.getsize(p) for p in paths) / 2**30, 3), "layers": layers,
            "mesh": a.mesh, "bytes_written": first["bytes"], "tensors": first["tensors"],
            "floor_direct_s": round(floor_s, 3), "floors_direct_s": [fl["write_direct_s"], fl2["write_direct_s"]],
            "job_s": [round(r["job_s"], 3) for r in runs], "wall_s": [round(r["wall_s"], 3) for r in runs],
            "median_job_s": round(statistics.median(r["job_s"] for r in runs), 3),
            "median_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
            "job_over_floor": round(statistics.median(r["job_s"] for r in runs) / floor_s, 2),
            # end to end: the process's wall (Python's start, the modules, the job, the exit) over the floor
            "process_s": [round(r["process_s"], 3) for r in runs],
            "median_process_s": round(statistics.median(r["process_s"] for r in runs), 3),
            "process_over_floor": round(statistics.median(r["process_s"] for r in runs) / floor_s, 2),
            "wall_over_floor": round(statistics.median(r["wall_s"] for r in runs) / floor_s, 2),
            "peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs)),
            "load_avg": os.getloadavg(),
        }
        row["variants"] = {
            v: {"job_s": [round(r["job_s"], 3) for r in rs],
                "median_job_s": round(statistics.median(r["job_s"] for r in rs), 3),
                "over_floor": round(statistics.median(r["job_s"] for r in rs) / floor_s, 2),
                "median_process_s": round(statistics.median(r["process_s"] for r in rs), 3),
                "process_over_floor": round(statistics.median(r["process_s"] for r in rs) / floor_s, 2),
                "read_busy_s": round(statistics.median(_busy(r, "read") for r in rs), 3),
                "cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 2),
                "peak_rss_mib": round(max(r["peak_rss_mib"] for r in rs))}
            for v, rs in by.items()
        }
        row["read_busy_s"] = round(statistics.median(_busy(r, "read") for r in runs), 3)
        if not a.json:
            from hybridckpt.cli.profile import profile_lines
            from hybridckpt.io.timing import Profile

            print("== the median run's account ==")
            print("\n".join(profile_lines(Profile.from_json(med["profile"]))))
        print(json.dumps(row))
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
