"""Benchmark (issue 42, "import at the floor"): sources of `--gib` GiB written by the real tools,
each imported with default flags against the O_DIRECT write floor of the bytes it writes,
measured in the same run, with the import's peak RSS and its per-stage account; one restore of
our store onto another mesh against the read floors.

    python benchmarks/import_sources_floor.py [--gib 4] [--sources dcp,hf,megatron] [--repeat 3]
        [--restore dcp] [--tree NAME=PATH] [--dir DIR] [--json]

The sources, one at a time (each deleted before the next is written):

- `dcp`: an FSDP2 run with AdamW saved by `torch.distributed.checkpoint.save` on 2 gloo ranks
  (`import_dcp_floor.write`: every param and moment a DTensor `Shard(0)`, `step`, `param_groups`),
  the Llama shapes of `consolidate_dcp`, params + two moments at least `--gib` GiB, with its HF
  config.json (`--config`);
- `hf`: transformers' `LlamaForCausalLM(config).save_pretrained(dir, max_shard_size="1GB")`
  (safetensors shards + index, fp32, the model's own random init), params at least `--gib` GiB;
- `megatron`: Megatron-Core 0.19.2 itself (`tests/real/generators/_megatron_core_run.py train` in
  the side venv `tests/real/make.py megatron_core` makes, ~/.cache/hybridckpt-real/megatron_core):
  Megatron-LM's `setup_model_and_optimizer`, one `train_step`, `save_checkpoint` with
  `--ckpt-format torch_dist` on 4 gloo CPU ranks (TP 2 x DP 2, distributed optimizer,
  `dp_reshardable`), a Llama-like GPT (GQA, SwiGLU, RMSNorm, untied head, fp32), model + the
  optimizer's fp32 main params and two moments at least `--gib` GiB (and one layer: ~1.2 GiB).

Then, per source, each import a fresh `python -m hybridckpt.cli import SRC DST --mesh fsdp=2,tp=2
--json` (default flags; `--json` turns the account on and prints it) on 8 simulated CPU devices,
page cache warm, bytecode cached: one warm-up (not counted: it says the bytes the import
writes), the write floors (`floors.measure`, best of 2) before, `--repeat` imports, the floors
again after, and one queued O_DIRECT floor (8 MiB files) just before each import. The row: the
median import's own seconds (the summary's `seconds`) and its process's wall (Python's start
included) over the best O_DIRECT floor of the run (the strict figure), the median over the
imports of each one's seconds over the floor just before it (`job_over_adjacent_floor`: the same
disk, where its rate drifts within a run, as this VM's does), the highest peak RSS (`wait4`'s
`ru_maxrss` of the child), the account of the median run, and whether the account's shares +
other/waiting (the account's wall by construction) cover the process's wall within 10%.

`--tree NAME=PATH` (repeatable) also runs, alternating with this checkout's (the order turned each
round), `--repeat` imports of each source by another checkout's code (a base commit unpacked at
PATH: `git archive main | tar -x -C PATH`), each in a fresh process with PYTHONPATH at it: a
same-run before/after, its row under `trees` (median seconds, the ratio to the same floor, CPU
seconds, peak RSS, the busy seconds of each stage of its median run).

`--restore SOURCE` (default `dcp`; `none`: skip): the last import of that source (on fsdp=2,tp=2)
restored onto fsdp=4 (`hybridckpt.restore(ck, "fsdp=4", profile=True)`, params and optimizer
state, every array blocked on), `--repeat` rounds warm then cold alternating, against the floors
of exactly its chunk files measured in the same round: warm `cat`, cold O_DIRECT reads into one
reused buffer (the pages dropped with `POSIX_FADV_DONTNEED`), and both kinds' reads into fresh
memory (`fresh_floors`: the strict floor, the fastest way, and the 4 KiB-page floor, each way and
the restore in its own process after the same preparation, the restore's place turned each round),
and against its peer, Orbax's own restore of the same store onto the same shardings in the same
rounds (`orbax_peer`).
Prints one table row per source and a JSON line. Records: docs/benchmarks.md "Sources of 4 GiB
made by the tools (issue 42)".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

HERE = os.path.abspath(__file__)
BENCH = os.path.dirname(HERE)
TREE = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

import consolidate_dcp  # noqa: E402
import floors  # noqa: E402
import fresh_floors  # noqa: E402
import import_dcp_floor  # noqa: E402
import restore_floor  # noqa: E402
from consolidate_dcp import FFN, HIDDEN, VOCAB  # noqa: E402
from orbax_peer import run_peer  # noqa: E402

SOURCES = ("dcp", "hf", "megatron")
IMPORT_MESH, RESTORE_MESH = "fsdp=2,tp=2", "fsdp=4"
RUN_CPU_FIELDS = ("job_s", "user_s", "system_s", "minor_faults", "major_faults", "machine_iowait_s", "machine_steal_s",
                  "machine_user_s", "machine_system_s", "machine_idle_s")  # (a restore's record: why a round was slow)
GENERATORS = os.path.join(TREE, "tests", "real", "generators")
MEGATRON_VENV = os.path.expanduser("~/.cache/hybridckpt-real/megatron_core")
# Megatron's model: Llama-like (the shapes of consolidate_dcp with GQA: 16 heads, 8 KV groups)
M_HIDDEN, M_HEADS, M_KV, M_FFN, M_VOCAB = 2048, 16, 8, 5632, 8192
M_TP, M_DP = 2, 2


def _env() -> dict:
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")


# ---- the writers: each the real tool -------------------------------------------------------

def dcp_layers(gib: float) -> int:
    """Layers of `consolidate_dcp`'s Llama whose params and two fp32 moments are at least `gib`
    GiB (`import_dcp_floor.layers_for` rounds to the nearest: 3.8 GiB for 4)."""
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN) * 4 * 3
    return max(1, math.ceil((gib * 2**30 - 2 * VOCAB * HIDDEN * 4 * 3) / per_layer))


def hf_layers(gib: float) -> int:
    """Layers of the same Llama whose fp32 params are at least `gib` GiB."""
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN) * 4
    return max(1, math.ceil((gib * 2**30 - 2 * VOCAB * HIDDEN * 4) / per_layer))


def write_dcp(src: str, gib: float) -> dict:
    layers = dcp_layers(gib)
    cfg = src + ".config.json"
    with open(cfg, "w") as f:
        json.dump(consolidate_dcp.hf_config(layers), f)
    subprocess.run([sys.executable, import_dcp_floor.HERE, "--_write", src, str(layers)], check=True,
                   capture_output=True)
    return {"writer": f"torch {version('torch')} torch.distributed.checkpoint.save, 2 gloo ranks, FSDP2 "
                      f"DTensor Shard(0) params + AdamW exp_avg/exp_avg_sq/step", "layers": layers, "config": cfg}


def _write_hf(src: str, layers: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in consolidate_dcp.hf_config(int(layers)).items()
                                      if k not in ("architectures", "model_type", "torch_dtype")})
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(src, max_shard_size="1GB")


def write_hf(src: str, gib: float) -> dict:
    layers = hf_layers(gib)
    subprocess.run([sys.executable, HERE, "--_write_hf", src, str(layers)], check=True, capture_output=True)
    return {"writer": f"transformers {version('transformers')} LlamaForCausalLM.save_pretrained("
                      f"max_shard_size='1GB'), fp32, safetensors shards + index", "layers": layers, "config": None}


def megatron_layers(gib: float) -> int:
    """Layers so that the fp32 model, the distributed optimizer's fp32 main params and AdamW's two
    moments (16 bytes a parameter, as megatron-core saves them) are at least `gib` GiB."""
    hd = M_HIDDEN // M_HEADS
    per_layer = (M_HEADS + 2 * M_KV) * hd * M_HIDDEN + M_HIDDEN * M_HEADS * hd + 3 * M_FFN * M_HIDDEN + 2 * M_HIDDEN
    rest = gib * 2**30 / 16 - 2 * M_VOCAB * M_HIDDEN
    return max(1, math.ceil(rest / per_layer))


def write_megatron(src: str, gib: float) -> dict:
    py = os.path.join(MEGATRON_VENV, "bin", "python")
    if not os.path.exists(py):
        raise SystemExit(f"{py}: no megatron-core side venv; make it with `python tests/real/make.py megatron_core`")
    sys.path.insert(0, GENERATORS)
    from megatron_core import COMMON  # the real cases' Megatron-LM arguments (tests/real)

    layers = megatron_layers(gib)
    over = {"--num-layers": layers, "--hidden-size": M_HIDDEN, "--num-attention-heads": M_HEADS,
            "--num-query-groups": M_KV, "--ffn-hidden-size": M_FFN, "--vocab-size": M_VOCAB,
            "--make-vocab-size-divisible-by": 128, "--train-iters": 1, "--global-batch-size": 2}
    args = list(COMMON)
    for k, v in over.items():
        args[args.index(k) + 1] = str(v)
    args += ["--tensor-model-parallel-size", str(M_TP), "--pipeline-model-parallel-size", "1", "--save", src]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = src + ".log"
    with open(log, "w") as f:
        r = subprocess.run([py, "-m", "torch.distributed.run", f"--nproc-per-node={M_TP * M_DP}", f"--master-port={port}",
                            os.path.join(GENERATORS, "_megatron_core_run.py"), "train",
                            json.dumps([[src, "torch_dist", False]]), "--", *args],
                           stdout=f, stderr=subprocess.STDOUT,
                           env=dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=""))
    if r.returncode:
        with open(log) as f:
            raise SystemExit(f"megatron-core's save failed ({r.returncode}):\n{f.read()[-4000:]}")
    os.remove(log)
    return {"writer": f"megatron-core 0.19.2 save_checkpoint --ckpt-format torch_dist, TP {M_TP} x DP {M_DP} gloo "
                      f"CPU ranks, distributed optimizer (dp_reshardable), after 1 train_step, fp32",
            "layers": layers, "config": None}


WRITERS = {"dcp": write_dcp, "hf": write_hf, "megatron": write_megatron}


# ---- the runs: each a fresh process ---------------------------------------------------------

# A launcher between this process and a measured one: Linux carries the high-water RSS of the
# process that forks (vfork: its whole life's) into the child's `ru_maxrss` at exec, and this
# benchmark holds the floors' buffers (a restore's whole store in `fresh_read_floor`); the
# launcher is a bare Python (~10 MB), so `wait4` there reports the child's own peak.
LAUNCHER = """
import json, os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "wall_s": time.perf_counter() - t0,
               "peak_rss_mib": ru.ru_maxrss / 1024, "cpu_s": ru.ru_utime + ru.ru_stime}, f)
"""


def launch(cmd: list[str], what: str, tree: str | None = None) -> tuple[dict, str]:
    """Run `cmd` (8 simulated CPU devices; `tree`: with PYTHONPATH at that checkout) through
    `LAUNCHER`: (its wall, peak RSS, CPU seconds; its stdout)."""
    env = _env() if tree is None else dict(_env(), PYTHONPATH=os.path.abspath(tree))
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        res, out, err = (os.path.join(tmp, n) for n in ("res.json", "out", "err"))
        with open(out, "w") as o, open(err, "w") as e:
            subprocess.run([sys.executable, "-S", "-c", LAUNCHER, res, *cmd], stdout=o, stderr=e, env=env,
                           check=True)
        with open(res) as f:
            r = json.load(f)
        if r["rc"]:
            with open(err) as f:
                raise SystemExit(f"{what} failed ({r['rc']}): {f.read()[-3000:]}")
        with open(out) as f:
            return r, f.read()


def run_import(src: str, dst: str, cfg: str | None, tree: str | None = None) -> dict:
    """One `hybridckpt import SRC DST --mesh IMPORT_MESH --json` in a fresh process (by the code
    of the checkout `tree`, default this one's): its summary (seconds, bytes, account), the
    process's wall, peak RSS and CPU seconds (`launch`)."""
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    cmd = [sys.executable, "-m", "hybridckpt.cli", "import", src, dst, "--mesh", IMPORT_MESH, "--json"]
    if cfg:
        cmd += ["--config", cfg]
    r, text = launch(cmd, f"import of {src}", tree)
    s = json.loads(text[text.index("{"):])
    return {**r, "job_s": s["seconds"], "bytes": s["bytes"], "tensors": s["tensors"], "profile": s["profile"]}


def restore_child(ck: str) -> dict:
    """One restore onto RESTORE_MESH in this process, params and optimizer state, every array
    blocked on: its seconds (modules loaded before), the bytes read, the account."""
    fresh_floors.load_restore_modules()  # (what a restore loads on first use: not its seconds)
    fresh_floors.back_memory(fresh_floors.files_bytes(restore_floor.chunk_files(ck)))  # (as each floor way's)
    import jax

    import hybridckpt
    from hybridckpt.io.byte_source import count_reads
    from hybridckpt.io.read_tally import tally

    u0, m0 = resource.getrusage(resource.RUSAGE_SELF), fresh_floors.machine_seconds()
    t1 = time.perf_counter()
    with count_reads() as counter:
        _, r = hybridckpt.restore(ck, RESTORE_MESH, profile=True)
        jax.block_until_ready((r.params, r.opt_state))
    job = time.perf_counter() - t1
    u1, m1 = resource.getrusage(resource.RUSAGE_SELF), fresh_floors.machine_seconds()
    placed = sum(a.nbytes for a in jax.tree.leaves((r.params, r.opt_state)) if hasattr(a, "nbytes"))
    return {"job_s": job, "read_bytes": tally(counter)[0], "placed_bytes": placed, "profile": r.profile.to_json(),
            "user_s": round(u1.ru_utime - u0.ru_utime, 3), "system_s": round(u1.ru_stime - u0.ru_stime, 3),
            "minor_faults": u1.ru_minflt - u0.ru_minflt, "major_faults": u1.ru_majflt - u0.ru_majflt,
            **{f"machine_{k}_s": round(m1[k] - m0[k], 3) for k in m0}}


def run_restore(ck: str) -> dict:
    """One restore in a fresh process (`restore_child`), with its peak RSS (`launch`)."""
    r, text = launch([sys.executable, HERE, "--_restore", ck], f"restore of {ck}")
    return {**json.loads(text.strip().splitlines()[-1]), "peak_rss_mib": r["peak_rss_mib"]}


# ---- the rows --------------------------------------------------------------------------------

def _account(run: dict) -> dict:
    from hybridckpt.io.timing import Profile

    p = Profile.from_json(run["profile"])
    shares = sum(s.share_s for s in p.stages) + p.other_s
    return {"account_wall_s": round(p.wall_s, 3), "shares_over_account_wall": round(shares / p.wall_s, 4),
            "other_share": round(p.other_s / p.wall_s, 3),
            "account_over_process_wall": round(p.wall_s / run["wall_s"], 3),
            "busy_s": {s.stage: round(s.busy_s, 3) for s in p.stages}}


def _adjacent(runs: list[dict]) -> dict:
    """The imports against the floor measured just before each (`adjacent_floor_s`: the queued
    O_DIRECT way, 8 MiB files): that floor's seconds and the median of the per-pair ratios (None
    where O_DIRECT was refused). This VM's disk writes a few GB fast and then, under sustained
    writes, takes 20-50% longer for the same bytes (docs/benchmarks.md, "Twenty-first stop"): the
    best floor of the run may be a moment no import ran in, and a pair sees the same disk."""
    adj = [r["adjacent_floor_s"] for r in runs]
    ok = all(a is not None for a in adj)
    return {"adjacent_floors_s": [a and round(a, 3) for a in adj],
            "job_over_adjacent_floor": round(statistics.median(r["job_s"] / r["adjacent_floor_s"] for r in runs), 2)
            if ok and runs else None}


def _tree_row(runs: list[dict], floor_s: float | None) -> dict:
    """A `--tree` checkout's imports: medians, the ratio to the run's floor, CPU, peak RSS, and the
    busy seconds of each stage of its median run."""
    job = statistics.median(r["job_s"] for r in runs)
    med = sorted(runs, key=lambda r: r["job_s"])[len(runs) // 2]
    return {"median_job_s": round(job, 3), "job_over_floor": round(job / floor_s, 2) if floor_s else None,
            "median_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
            "job_s": [round(r["job_s"], 3) for r in runs], **_adjacent(runs),
            "cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 2),
            "peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs)), "busy_s": _account(med)["busy_s"]}


def bench_import(kind: str, base: str, gib: float, repeat: int, keep_ck: bool, quiet: bool,
                 trees: dict[str, str] | None = None) -> tuple[dict, str | None]:
    src, ck = os.path.join(base, kind), os.path.join(base, f"{kind}.orbax")
    t0 = time.perf_counter()
    made = WRITERS[kind](src, gib)
    write_s = time.perf_counter() - t0
    paths = [p for p in floors.files_under(src)]
    first = run_import(src, ck, made["config"])  # a warm-up, not counted; says the bytes written
    fl = [floors.measure(paths, os.path.join(base, "floor"), write_bytes=first["bytes"])]
    variants = [None, *(trees or {})]
    by: dict = {v: [] for v in variants}
    for i in range(repeat):  # alternating, the order turned each round: a slower minute hits all
        for v in variants if i % 2 == 0 else variants[::-1]:
            adjacent = floors.queued_direct_write_floor(paths, os.path.join(base, "floor"), first["bytes"])[0]
            run = run_import(src, ck, made["config"], None if v is None else trees[v])
            by[v].append({**run, "adjacent_floor_s": adjacent})
    runs = by[None]
    fl.append(floors.measure(paths, os.path.join(base, "floor"), write_bytes=first["bytes"]))
    direct = [f["write_direct_s"] for f in fl if f["write_direct_s"] is not None]
    floor_s = min(direct) if direct else None
    med = sorted(runs, key=lambda r: r["job_s"])[len(runs) // 2]
    job, wall = statistics.median(r["job_s"] for r in runs), statistics.median(r["wall_s"] for r in runs)
    acc = _account(med)
    row = {
        "source": kind, "writer": made["writer"], "layers": made["layers"], "write_s": round(write_s, 1),
        "source_gib": round(sum(os.path.getsize(p) for p in paths) / 2**30, 3), "files": len(paths),
        "mesh": IMPORT_MESH, "bytes_written": first["bytes"], "tensors": first["tensors"],
        "floor_direct_s": round(floor_s, 3) if floor_s else None,
        "floors_direct_s": [f["write_direct_s"] and round(f["write_direct_s"], 3) for f in fl],
        "floors_direct_serial_s": [f["write_direct_serial_s"] and round(f["write_direct_serial_s"], 3) for f in fl],
        "floors_direct_queued_s": [f["write_direct_queued_s"] and round(f["write_direct_queued_s"], 3) for f in fl],
        "floors_direct_queued_by_mib": [{k: round(v, 3) for k, v in f["write_direct_queued_by_mib"].items()} for f in fl],
        "floors_buffered_s": [round(f["write_s"], 3) for f in fl],
        "median_job_s": round(job, 3), "median_wall_s": round(wall, 3),
        "job_over_floor": round(job / floor_s, 2) if floor_s else None,
        "wall_over_floor": round(wall / floor_s, 2) if floor_s else None,
        "job_s": [round(r["job_s"], 3) for r in runs], "wall_s": [round(r["wall_s"], 3) for r in runs],
        **_adjacent(runs), "cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 2),
        "peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs)),
        **acc, "account_within_10pct": abs(acc["account_over_process_wall"] - 1) <= 0.10,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    if trees:
        row["trees"] = {v: _tree_row(by[v], floor_s) for v in trees}
    if not quiet:
        from hybridckpt.cli.profile import profile_lines
        from hybridckpt.io.timing import Profile

        print(f"== {kind}: {row['writer']}; the median import's account ==", flush=True)
        print("\n".join(profile_lines(Profile.from_json(med["profile"]))), flush=True)
        print(json.dumps(row), flush=True)
    shutil.rmtree(src, ignore_errors=True)
    if made["config"]:
        os.remove(made["config"])
    if not keep_ck:
        shutil.rmtree(ck, ignore_errors=True)
        return row, None
    return row, ck


def bench_restore(ck: str, repeat: int, quiet: bool) -> dict:
    """Restores of `ck` onto RESTORE_MESH, warm and cold, `repeat` rounds each, against the
    floors of the same round: warm `cat`, cold O_DIRECT reads into one reused buffer, and both
    kinds' fresh-memory ways (`fresh_floors.measured_round`: the restore among them, each in its
    own process after the same preparation, its place turned each round); medians."""
    files = restore_floor.chunk_files(ck)
    stored = sum(os.path.getsize(p) for p in files)
    runs: dict[str, list] = {k: [] for k in ("warm", "cold", "cat", "fresh", "fresh_small", "direct", "direct_fresh",
                                             "direct_fresh_small", "peer_warm", "peer_cold")}
    run_restore(ck)  # a warm-up, not counted
    for i in range(repeat):
        for kind in ("warm", "cold") if i % 2 == 0 else ("cold", "warm"):
            if kind == "warm":
                floors.read_floor(files)
                runs["cat"].append(floors.read_floor(files))
            else:
                fresh_floors.drop_pages(files)
                runs["direct"].append(restore_floor.direct_read_floor(files))
            got, ways = fresh_floors.measured_round(files, direct=kind == "cold", turn=i, restore=lambda: run_restore(ck))
            fresh = "fresh" if kind == "warm" else "direct_fresh"
            runs[kind].append(got)
            runs[fresh].append(fresh_floors.fastest(ways))
            runs[fresh + "_small"].append(fresh_floors.fastest_small(ways))
            fresh_floors.prepare(files, direct=kind == "cold")  # the peer: Orbax's own restore, prepared alike
            runs[f"peer_{kind}"].append(run_peer(ck, RESTORE_MESH))
    med = {k: statistics.median(r["job_s"] if isinstance(r, dict) else r for r in v) for k, v in runs.items()}
    row = {"mesh": f"{IMPORT_MESH} -> {RESTORE_MESH}", "stored_bytes": stored, "chunk_files": len(files),
           "warm_s": round(med["warm"], 3), "cold_s": round(med["cold"], 3),
           "floor_cat_s": round(med["cat"], 3), "floor_fresh_s": round(med["fresh"], 3),
           "floor_fresh_small_s": round(med["fresh_small"], 3), "floor_direct_s": round(med["direct"], 3),
           "floor_direct_fresh_s": round(med["direct_fresh"], 3),
           "floor_direct_fresh_small_s": round(med["direct_fresh_small"], 3),
           "warm_over_cat": round(med["warm"] / med["cat"], 2), "warm_over_fresh": round(med["warm"] / med["fresh"], 2),
           "warm_over_fresh_small": round(med["warm"] / med["fresh_small"], 2),
           "cold_over_direct": round(med["cold"] / med["direct"], 2),
           "cold_over_direct_fresh": round(med["cold"] / med["direct_fresh"], 2),
           "cold_over_direct_fresh_small": round(med["cold"] / med["direct_fresh_small"], 2),
           "peer": restore_floor.PEER, "peer_warm_s": round(med["peer_warm"], 3), "peer_cold_s": round(med["peer_cold"], 3),
           "peer_over_warm": round(med["peer_warm"] / med["warm"], 2), "peer_over_cold": round(med["peer_cold"] / med["cold"], 2),
           "peer_peak_rss_mib": round(max(r["peak_rss_mb"] for r in runs["peer_warm"] + runs["peer_cold"])),
           "read_over_stored": round(statistics.median(r["read_bytes"] for r in runs["warm"]) / stored, 4),
           "placed_bytes": runs["warm"][0]["placed_bytes"],
           "peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs["warm"] + runs["cold"])),
           "runs_s": {k: [round(r["job_s"] if isinstance(r, dict) else r, 3) for r in v] for k, v in runs.items()},
           "runs_cpu": {k: [{f: r.get(f) for f in RUN_CPU_FIELDS} for r in runs[k]] for k in ("warm", "cold")},
           "floor_fresh_ways": fresh_floors.WAYS_SEEN[-2 * repeat:],
           "load_avg": [round(x, 2) for x in os.getloadavg()]}
    if not quiet:
        from hybridckpt.cli.profile import profile_lines
        from hybridckpt.io.timing import Profile

        m = sorted(runs["warm"], key=lambda r: r["job_s"])[len(runs["warm"]) // 2]
        print(f"== restore {row['mesh']}, warm: the median run's account ==", flush=True)
        print("\n".join(profile_lines(Profile.from_json(m["profile"]))), flush=True)
        print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], restore: dict | None, restored: str | None) -> str:
    out = ["| source (writer) | GiB | written | O_DIRECT floor | import (x floor) | x the floor just before (median "
           "of pairs) | process wall (x floor) | peak RSS | account / wall |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['source']} | {r['source_gib']:.2f} | {r['bytes_written'] / 2**30:.2f} GiB | "
                   f"{r['floor_direct_s']} s | {r['median_job_s']} s ({r['job_over_floor']}x) | "
                   f"{r['job_over_adjacent_floor']}x | {r['median_wall_s']} s ({r['wall_over_floor']}x) | "
                   f"{r['peak_rss_mib']} MiB | "
                   f"{r['account_over_process_wall']} ({'within' if r['account_within_10pct'] else 'NOT within'} 10%) |")
        for name, t in r.get("trees", {}).items():
            out.append(f"| {r['source']}, tree {name} | | | | {t['median_job_s']} s ({t['job_over_floor']}x) | "
                       f"{t['job_over_adjacent_floor']}x | {t['median_wall_s']} s | {t['peak_rss_mib']} MiB | "
                       f"CPU {t['cpu_s']} s (this tree: {r['cpu_s']} s) |")
    if restore:
        out.append(f"\nrestore of the {restored} import {restore['mesh']} ({restore['stored_bytes'] / 2**30:.2f} GiB): "
                   f"warm {restore['warm_s']} s ({restore['warm_over_cat']}x cat {restore['floor_cat_s']} s, "
                   f"{restore['warm_over_fresh']}x fresh memory {restore['floor_fresh_s']} s, "
                   f"{restore['warm_over_fresh_small']}x its 4 KiB pages {restore['floor_fresh_small_s']} s); cold "
                   f"{restore['cold_s']} s ({restore['cold_over_direct']}x O_DIRECT {restore['floor_direct_s']} s, "
                   f"{restore['cold_over_direct_fresh']}x into fresh memory {restore['floor_direct_fresh_s']} s, "
                   f"{restore['cold_over_direct_fresh_small']}x its 4 KiB pages {restore['floor_direct_fresh_small_s']} s); "
                   f"peak RSS {restore['peak_rss_mib']} MiB; Orbax's own restore onto the same shardings: warm "
                   f"{restore['peer_warm_s']} s ({restore['peer_over_warm']}x ours), cold {restore['peer_cold_s']} s "
                   f"({restore['peer_over_cold']}x ours), peak RSS {restore['peer_peak_rss_mib']} MiB")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--restore", default="dcp", help="the source whose import is restored onto another mesh (none: skip)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="also run, alternating, imports by the hybridckpt of another checkout (e.g. `git archive "
                         "main | tar -x -C PATH`): a same-run before/after")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true", help="print the JSON line only")
    ap.add_argument("--_write_hf", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_restore", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._write_hf:
        _write_hf(*a._write_hf)
        return
    if a._restore:
        print(json.dumps(restore_child(a._restore)))
        return
    trees = dict(t.split("=", 1) for t in a.tree)
    if bad := [p for p in trees.values() if not os.path.isdir(os.path.join(p, "hybridckpt"))]:
        raise SystemExit(f"--tree: no hybridckpt checkout at {bad}")
    kinds = a.sources.split(",")
    if bad := [k for k in kinds if k not in SOURCES]:
        raise SystemExit(f"--sources: unknown {bad}; expected some of {','.join(SOURCES)}")
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-sources-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    floors.cached_bytecode(base)
    t0 = time.perf_counter()
    rows, restore = [], None
    try:
        for kind in kinds:
            row, ck = bench_import(kind, base, a.gib, a.repeat, keep_ck=kind == a.restore, quiet=a.json, trees=trees)
            rows.append(row)
            if ck:
                restore = bench_restore(ck, a.repeat, a.json)
                shutil.rmtree(ck, ignore_errors=True)
        if not a.json:
            print(table(rows, restore, a.restore), flush=True)
        print(json.dumps({"gib": a.gib, "repeat": a.repeat, "cpus": os.cpu_count(), "rows": rows, "restore": restore,
                          "restored": a.restore if restore else None, "seconds": round(time.perf_counter() - t0)}))
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
