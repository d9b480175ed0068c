"""Benchmark (e): consolidate checkpoints of no known model (no config anywhere) into one file.

    python benchmarks/consolidate_plain.py [--dcp-gib 1] [--zero-gib 1] [--only dcp|zero3]
                                           [--dir DIR] [--keep]

Both sources hold 4096 x 4096 fp32 tensors named `model.layers.N.mlp.up_proj.weight` (layout
`[out, in]`, 64 MiB each, N chosen for the size) and no model config: `hybridckpt export SRC OUT`
runs without `--config`, so the tensors keep the source's own names (the model-agnostic path).

(a) DCP: the state dict saved by one process with `dcp.save(sd, checkpoint_id=..., no_dist=True)`
    (one `__0_0.distcp`, one chunk per tensor). Reference: torch's
    `dcp_to_torch_save(SRC, OUT.pt)` (torch/distributed/checkpoint/format_utils.py: the whole
    state dict in memory, then `torch.save`).
(b) DeepSpeed ZeRO-3: the same kind of model (bias-free `Linear`s, fp32, AdamW with
    `torch_adam`) trained one step by 2 gloo ranks on CPU and saved with
    `engine.save_checkpoint` (fp32 masters and both moments in each rank's
    `zero_pp_rank_R_mp_rank_00_optim_states.pt`, every tensor split over the 2 ranks).
    Reference: DeepSpeed's `zero_to_fp32` as its script runs it
    (`convert_zero_checkpoint_to_fp32_state_dict(SRC, OUT, safe_serialization=True)`, which is
    `get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)` then safetensors'
    `save_file`; deepspeed/utils/zero_to_fp32.py), and the documented in-memory API
    (`get_fp32_state_dict_from_zero_checkpoint(SRC)` then `torch.save`).

Each command runs in its own process under `/usr/bin/time` (wall seconds, peak RSS: the
process's high-water mark), page cache warm; ours fsyncs its output before the atomic rename,
the references do not, so each reference process then fsyncs its output, timed apart: reported
without it (as users run it) and, as the durable equivalent, with it. The two alternate
`--repeat` times (default 3) with `sync` (untimed) before each run; the run of median time of
each is kept.
Then the outputs are compared bit for bit. The references' time includes importing torch (and
deepspeed), which users pay too; `import_s` says how long that import alone takes.

`run_dcp(gib, base)` and `run_zero3(gib, base)` return the figures; `benchmarks/run_all.py`
prints them in its table (`--only plain` runs these rows alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
import floors  # noqa: E402
from consolidate_dcp import check_same, timed, torch_consolidate  # noqa: E402
from import_megatron import median_run  # noqa: E402

DIM = 4096  # every tensor DIM x DIM fp32
GIB = 2**30


def name(i: int) -> str:
    return f"model.layers.{i}.mlp.up_proj.weight"


def tensors_for(gib: float) -> int:
    return max(1, round(gib * GIB / (DIM * DIM * 4)))


# -- writers (each in its own process) -----------------------------------------------------------


def write_dcp(out: str, n: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {name(i): torch.randn(DIM, DIM, generator=g) * 0.02 for i in range(n)}
    dcp.save(sd, checkpoint_id=out, no_dist=True)


def _zero3_rank(rank: int, out: str, n: int, port: int) -> None:
    import deepspeed
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_SIZE="2")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(DIM, DIM, bias=False)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp()

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(n))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Stack()

        def forward(self, x):
            for layer in self.model.layers:
                x = layer.mlp.up_proj(x)
            return x.pow(2).mean()

    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):  # each rank allocates only its partition
        model = Model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x))
    engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def write_zero3(out: str, n: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed.comm.torch  # noqa: F401
    import torch.multiprocessing as mp

    # the CPU accelerator JIT-compiles a shared-memory allreduce op (minutes); gloo does the job
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_zero3_rank, args=(out, n, port), nprocs=2, start_method="fork")


# -- references (each in its own process) -----------------------------------------------------------


def _fsync_all(path: str) -> float:
    """fsync every file under `path` (a file or a folder); returns the seconds it took."""
    t0 = time.perf_counter()
    floors.fsync_files([path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)])
    return time.perf_counter() - t0


def zero_consolidate(src: str, dst: str, how: str) -> float:
    """DeepSpeed's zero_to_fp32 (`how`: "script" = the script's safetensors conversion, "api" =
    `get_fp32_state_dict_from_zero_checkpoint` + `torch.save`), then an fsync of its output;
    returns the fsync's seconds."""
    from deepspeed.utils import zero_to_fp32

    if how == "script":
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(src, dst, safe_serialization=True)
    else:
        import torch

        torch.save(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(src), dst)
    return _fsync_all(dst)


def check_same_safetensors(ours: str, theirs: str) -> int:
    """Every tensor of the two safetensors folders bit for bit; returns the tensor count."""
    import torch
    from safetensors import safe_open

    def load(folder):
        out = {}
        for f in sorted(os.listdir(folder)):
            if f.startswith("model") and f.endswith(".safetensors"):
                with safe_open(os.path.join(folder, f), "pt") as st:
                    out |= {k: st.get_tensor(k) for k in st.keys()}
        return out

    a, b = load(ours), load(theirs)
    if sorted(a) != sorted(b):
        raise SystemExit(f"names differ: hybridckpt {sorted(a)[:4]}..., zero_to_fp32 {sorted(b)[:4]}...")
    for k in a:
        if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
            raise SystemExit(f"{k}: hybridckpt's output differs from zero_to_fp32's")
    return len(a)


# -- the runs -------------------------------------------------------------------------------------------


def _env(**extra: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **extra}


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def alternate(cmds: dict[str, tuple[list[str], str, dict]], repeat: int) -> dict[str, dict]:
    """Run each `key: (cmd, output, env)` `repeat` times, alternating, `sync` (untimed) before
    each run, the output removed first; the run of median time of each (references: the time without
    their fsync in `seconds`, with it in `durable_seconds`)."""
    runs: dict[str, list[dict]] = {k: [] for k in cmds}
    for _ in range(repeat):
        for key, (cmd, out, env) in cmds.items():
            _remove(out)
            subprocess.run(["sync"], check=True)
            runs[key].append(timed(cmd, env))
    best = {}
    for key, rs in runs.items():
        if key != "ours":
            for r in rs:
                r["durable_seconds"], r["seconds"] = r["seconds"], r["seconds"] - r["fsync_s"]
        best[key] = median_run(rs)
    return best


def _import_seconds(module: str, env: dict) -> float:
    """Wall seconds of a process that only imports `module` (best of 2)."""
    return min(timed([sys.executable, "-c", f"import {module}"], env)["seconds"] for _ in range(2))


def _warm(src: str) -> int:
    """Flush the write's dirty pages, read every source file once; returns the source's bytes."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]
    subprocess.run(["sync"], check=True)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return sum(os.path.getsize(f) for f in files)


def _ours(src: str, out: str) -> list[str]:
    return [sys.executable, "-m", "hybridckpt.cli", "export", src, out, "--quiet"]


def run_dcp(gib: float, base: str, *, keep: bool = False, repeat: int = 3) -> dict:
    """(a): write the DCP checkpoint under `base`, time both consolidations, check they agree."""
    n = tensors_for(gib)
    src, out, pt = (os.path.join(base, x) for x in ("plain-dcp", "plain-dcp-out", "plain-dcp.pt"))
    os.makedirs(base, exist_ok=True)
    _remove(src)
    subprocess.run([sys.executable, HERE, "--_write-dcp", src, str(n)], check=True, capture_output=True)
    try:
        nbytes = _warm(src)
        fl = floors.measure(floors.files_under(src), os.path.join(base, "floor"))
        env = _env()
        best = alternate({
            "ours": (_ours(src, out), out, env),
            "torch": ([sys.executable, HERE, "--_torch", src, pt], pt, env),
        }, repeat)
        subprocess.run(["sync"], check=True)
        tensors = int(subprocess.run(
            [sys.executable, HERE, "--_check-pt", pt, out], check=True, capture_output=True, text=True
        ).stdout.split()[-1])
        best["torch"]["import_s"] = _import_seconds("torch", env)
    finally:
        if not keep:
            for p in (src, out, pt):
                _remove(p)
    return {"gib": gib, "bytes": nbytes, "tensors": tensors, "hybridckpt": best["ours"], "torch": best["torch"],
            "floors": fl}


def run_zero3(gib: float, base: str, *, keep: bool = False, repeat: int = 3) -> dict:
    """(b): write the ZeRO-3 checkpoint under `base`, time ours and both zero_to_fp32 forms,
    check the outputs agree."""
    n = tensors_for(gib)
    src = os.path.join(base, "plain-zero3")
    out, st, pt = (os.path.join(base, x) for x in ("plain-zero3-out", "plain-zero3-st", "plain-zero3.pt"))
    os.makedirs(base, exist_ok=True)
    _remove(src)
    env = _env(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
    w = subprocess.run([sys.executable, HERE, "--_write-zero3", src, str(n)], capture_output=True, text=True, env=env)
    if w.returncode != 0:
        raise SystemExit(f"the ZeRO-3 writer failed:\n{w.stdout[-2000:]}\n{w.stderr[-4000:]}")
    try:
        nbytes = _warm(src)
        tag = open(os.path.join(src, "latest")).read().strip()
        params = 4 * n * DIM * DIM
        fl = floors.measure(floors.files_under(src), os.path.join(base, "floor"), write_bytes=params)
        best = alternate({
            "ours": (_ours(src, out), out, env),
            "script": ([sys.executable, HERE, "--_zero", src, st, "script"], st, env),
            "api": ([sys.executable, HERE, "--_zero", src, pt, "api"], pt, env),
        }, repeat)
        subprocess.run(["sync"], check=True)
        tensors = int(subprocess.run(
            [sys.executable, HERE, "--_check-st", out, st], check=True, capture_output=True, text=True, env=env
        ).stdout.split()[-1])
        check_pt = subprocess.run([sys.executable, HERE, "--_check-pt", pt, out], capture_output=True, text=True)
        if check_pt.returncode != 0:
            raise SystemExit(f"hybridckpt's output differs from get_fp32_state_dict_from_zero_checkpoint's:\n"
                             f"{check_pt.stdout[-1000:]}{check_pt.stderr[-2000:]}")
        imp = _import_seconds("deepspeed.utils.zero_to_fp32", env)
        best["script"]["import_s"] = best["api"]["import_s"] = imp
    finally:
        if not keep:
            for p in (src, out, st, pt):
                _remove(p)
    return {"gib": gib, "bytes": nbytes, "param_bytes": params, "tensors": tensors, "tag": tag,
            "hybridckpt": best["ours"], "zero_to_fp32": best["script"], "zero_to_fp32_api": best["api"], "floors": fl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcp-gib", type=float, default=1.0)
    ap.add_argument("--zero-gib", type=float, default=1.0)
    ap.add_argument("--only", choices=("dcp", "zero3"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--_write-dcp", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_write-zero3", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_torch", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_zero", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_check-pt", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_check-st", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._write_dcp:
        return write_dcp(a._write_dcp[0], int(a._write_dcp[1]))
    if a._write_zero3:
        return write_zero3(a._write_zero3[0], int(a._write_zero3[1]))
    if a._torch:
        return print(f"FSYNC {torch_consolidate(*a._torch)}")
    if a._zero:
        return print(f"FSYNC {zero_consolidate(*a._zero)}")
    if a._check_pt:
        return print(check_same(*a._check_pt))
    if a._check_st:
        return print(check_same_safetensors(*a._check_st))
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    try:
        out = {}
        if a.only in (None, "dcp"):
            out["dcp"] = run_dcp(a.dcp_gib, base, keep=a.keep, repeat=a.repeat)
        if a.only in (None, "zero3"):
            out["zero3"] = run_zero3(a.zero_gib, base, keep=a.keep, repeat=a.repeat)
        print(json.dumps(out, indent=1))
    finally:
        if a.dir is None and not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
