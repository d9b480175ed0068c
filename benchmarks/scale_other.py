"""(h, other formats) What is where in many-rank checkpoints that are not Llama DCP: time and memory.

Each source is read in fresh processes, alternating, `--repeats` times, by the tool's own reader
and by `hybridckpt inspect PATH` (the whole command: open the format, check every file and
piece, print the summary):

- `dsv3`: a torchtitan 0.3 DeepSeek V3 671B DCP checkpoint with EP (`scale_sources_moe.py`);
  baseline torch's `FileSystemReader(path).read_metadata()`.
- `zero3`: a DeepSpeed ZeRO-3 checkpoint of Llama 3.1 405B (`scale_zero3.py`); baseline
  DeepSpeed's own `zero_to_fp32` parse step, the part of its loader that reads no weight data:
  `parse_model_states(get_model_state_files(d))` and `parse_optim_states(get_optim_files(d), d)`
  (every model-states file `torch.load`ed, every optim-states file `torch.load(mmap=True)`).
- `megatron`: Megatron-LM legacy per-rank folders (`scale_megatron.py`); baseline
  `torch.load(f, mmap=True, weights_only=False)` of every rank's `model_optim_rng.pt` and
  `distrib_optim.pt`, what Megatron's own loader does per rank (`checkpointing.py`
  `_load_base_checkpoint`, the distributed optimizer's `load_parameter_state`), all ranks
  (megatron's enum classes in `args` are stand-ins: megatron does not import here).
- `flex`: a PaddleFormers FlexCheckpoint step folder (`scale_flex.py`, metadata by paddle 3.3.1,
  data files empty); ours is `flex_checkpoint.metadata.read_metadata` of its three checkpoints
  (what opening reads before any data file), the baseline `paddle.load` of the three
  `0.metadata` files, run by `PADDLE_PYTHON` (paddle does not install in the project's venv).
- `flexdata`: the same with sparse data files (`scale_flex.py --sparse`): the whole `hybridckpt
  inspect` (which also parses the data files holding the beta pows), against the same baseline
  (paddle has no loader that reads a data file without its arrays: a lower bound).
- `paddle`: PaddleNLP hybrid per-rank `.pdparams` / `.pdopt` folders (`scale_paddle.py`): the whole
  `hybridckpt inspect`, no baseline: `paddle.load` unpickles every array of a file (the arrays are
  inside the pickle: 50-76 GB a file at 64 ranks) and paddle has no header-only reader.

A source is `KIND:PATH` (written beforehand by its script). Each row: the median time of the
timed call (imports excluded: for `inspect`, the CLI's modules and every reader's imported before
the timer, as torch's are, `imports` in the JSON) and the median peak RSS (`ru_maxrss`, imports
included), and the ratio of ours to the baseline's medians of the same run; then (stderr) the
medians of the timed call's CPU seconds (`cpu`; on a shared machine the steadier figure).
`--json FILE` keeps every sample.

    python benchmarks/scale_other.py --repeats 3 dsv3:/tmp/scale_other/dsv3_64 \\
        zero3:/tmp/scale_other/z3_512/global_step1000 megatron:/tmp/scale_other/mlm_512
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
import io, json, os, resource, sys, time, contextlib, glob
kind, path = sys.argv[1], sys.argv[2]
n = imports = None
if kind == "dcp":
    from torch.distributed.checkpoint import FileSystemReader
    t0, c0 = time.perf_counter(), time.process_time()
    md = FileSystemReader(path).read_metadata()
    n = sum(len(getattr(e, "chunks", ())) for e in md.state_dict_metadata.values())
elif kind == "deepspeed":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import zero_to_fp32 as z
    z.tqdm = lambda x, **k: x
    t0, c0 = time.perf_counter(), time.process_time()
    models = z.parse_model_states(z.get_model_state_files(path))
    stage, world, flats, _ = z.parse_optim_states(z.get_optim_files(path), path)
    n = sum(len(m.param_shapes[0]) + len(m.param_shapes[-1]) for m in models[:1])
elif kind == "torch_mmap":
    import torch
    sys.path.insert(0, sys.argv[3])
    from scale_megatron import _PICKLE  # megatron's enums in `args`, without megatron
    t0, c0 = time.perf_counter(), time.process_time()
    files = sorted(glob.glob(os.path.join(path, "*", "mp_rank_*", "*.pt")))
    n = 0
    for f in files:
        sd = torch.load(f, mmap=True, weights_only=False, map_location="cpu", pickle_module=_PICKLE)
        n += len(sd.get("model", ()))
        del sd
elif kind == "paddle_load":  # paddle's own metadata read (load_state_dict's first step)
    import paddle
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(len(paddle.load(os.path.join(path, d, "0.metadata")).storage_metadata)
            for d in ("model_state", "optimizer_state", "master_weight"))
elif kind == "flex_metadata":
    from hybridckpt.formats.flex_checkpoint.metadata import read_metadata
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(sum(map(len, read_metadata(os.path.join(path, d)).blocks.values()))
            for d in ("model_state", "optimizer_state", "master_weight"))
elif kind == "inspect":
    t0, c0 = time.perf_counter(), time.process_time()
    from hybridckpt.cli import main
    import hybridckpt.cli.parser, hybridckpt.jobs.inspect  # what main imports on the way
    from hybridckpt.formats import registry
    for f in registry.READABLE:  # every reader module (`detect` tries them in order): imports, as torch's are
        f.reader
    imports = time.perf_counter() - t0
    out = io.StringIO()
    t0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        rc = main(["inspect", path])
    assert rc == 0, out.getvalue()[-2000:]
else:
    raise SystemExit(kind)
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cpu = time.process_time() - c0  # CPU of the timed call (all threads)
print(json.dumps({"seconds": dt, "cpu": cpu, "peak_rss": rss, "count": n, "imports": imports}))
"""

BASELINE = {"dsv3": "dcp", "zero3": "deepspeed", "megatron": "torch_mmap", "flex": "paddle_load",
            "flexdata": "paddle_load", "paddle": None}
OURS = {"flex": "flex_metadata"}  # the sources' data files are empty: metadata only
LABEL = {"dcp": "torch `read_metadata`", "deepspeed": "DeepSpeed `zero_to_fp32` parse",
         "torch_mmap": "`torch.load(mmap=True)` of every rank", "paddle_load": "`paddle.load` of the 3 metadata"}
PADDLE_PYTHON = os.path.expanduser("~/.cache/hybridckpt-real/paddleformers/bin/python")


def drop_cache(path: str) -> None:
    """Drop the page cache of every file under `path` (POSIX_FADV_DONTNEED: clean pages only, of
    these files only): the next read comes from the disk, as a first open of a checkpoint does."""
    for d, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_one(kind: str, path: str, tree: str, cold: bool = False) -> dict:
    """One fresh process reading `path` as `kind`, with `tree` first on PYTHONPATH (`cold`: the
    source's page cache dropped first)."""
    if cold:
        drop_cache(path)
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("JAX_PLATFORMS", "cpu")
    exe = PADDLE_PYTHON if kind == "paddle_load" else sys.executable
    p = subprocess.run([exe, "-c", _CHILD, kind, path, HERE], env=env, capture_output=True,
                       text=True, cwd="/", check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} on {path} failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", help="KIND:PATH, KIND one of " + ", ".join(BASELINE))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", help="a source tree of the version to compare with (its inspect runs too)")
    ap.add_argument("--json", help="write every sample here")
    ap.add_argument("--cold", action="store_true", help="drop the source's page cache before every run")
    a = ap.parse_args(argv)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    rows, samples = [], {}
    for src in a.sources:
        kind, path = src.split(":", 1)
        ours = OURS.get(kind, "inspect")
        base = [(BASELINE[kind], TREE)] if BASELINE[kind] else []
        runs = base + [(ours, TREE)] + ([(ours, a.before)] if a.before else [])
        names = ["base"] * bool(base) + ["after"] + (["before"] if a.before else [])
        got = {k: [] for k in names}
        for i in range(a.repeats):
            order = list(zip(names, runs, strict=True))
            for name, (k, tree) in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                got[name].append(run_one(k, path, tree, a.cold))
                log(f"  {src} {name}: {got[name][-1]['seconds']:.1f} s, "
                    f"{got[name][-1]['peak_rss'] / 2**30:.2f} GiB ({time.perf_counter() - t0:.0f} s with imports)")
        med = {k: (statistics.median(r["seconds"] for r in v), statistics.median(r["peak_rss"] for r in v))
               for k, v in got.items()}
        samples[src] = got
        rows.append((src, BASELINE[kind], med))
        cpu = {k: statistics.median(r.get("cpu", float("nan")) for r in v) for k, v in got.items()}
        log(f"  {src} CPU seconds of the timed call, medians: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in cpu.items())
            + (f"; after / base {cpu['after'] / cpu['base']:.2f}x" if "base" in cpu else ""))
    print("| source | baseline | baseline time, memory | `hybridckpt inspect` | "
          + ("`inspect` before | " if a.before else "") + "ours / baseline (time, memory) |")
    print("|---" * (5 + bool(a.before)) + "|")
    for src, base, med in rows:
        cells = [f"{med[k][0]:.1f} s, {med[k][1] / 2**30:.2f} GiB" if k in med else "none"
                 for k in ("base", "after", "before") if k in med or k == "base"]
        ratio = (f"{med['after'][0] / med['base'][0]:.2f}x, {med['after'][1] / med['base'][1]:.2f}x"
                 if "base" in med else "-")
        print(f"| {src} | {LABEL.get(base, 'none')} | " + " | ".join(cells) + f" | {ratio} |")
    print(f"(medians of {a.repeats} fresh processes each, alternating; load average at the end "
          f"{os.getloadavg()[0]:.1f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
