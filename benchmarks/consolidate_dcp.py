"""Benchmark (a): consolidate a torch DCP checkpoint into one single-card file.

    python benchmarks/consolidate_dcp.py [--gib 1.1] [--layout fsdp|tp] [--dir DIR] [--keep]

A Llama-shaped fp32 state dict under HF names (hidden 2048, MHA, SwiGLU 5632, vocab 8192,
untied head; layers chosen for `--gib`) is saved by 2 gloo processes with
`torch.distributed.checkpoint.save`, every tensor a DTensor over 2 ranks (each rank creates
only its half), so each tensor is two chunks in two `.distcp` files. `--layout fsdp` (FSDP2)
shards every tensor on dim 0; `--layout tp` shards `o_proj` and `down_proj` on dim 1 as tensor
parallelism does (row-parallel: 30% of the bytes), the rest on dim 0. Then, each command in its
own process under `/usr/bin/time` (wall seconds, peak RSS), page cache warm:

- hybridckpt: `hybridckpt export DCP OUT --config config.json` (HF safetensors, streamed,
  fsync'd before the atomic rename; dim-0 chunks are copied file to file through the O_DIRECT
  write buffer, never materialised, dim-1 chunks read and interleaved);
- torch: `dcp_to_torch_save(DCP, OUT.pt)` (torch/distributed/checkpoint/format_utils.py:
  loads the whole state dict into memory, then `torch.save`; no fsync). The same process then
  fsyncs the output, timed apart: torch's time is reported without it (as users run it) and,
  as the durable equivalent of what hybridckpt does, with it.

The two alternate `repeat` times (default 3) with `sync` (untimed) before each run; the run of
median time of each is kept.

Then a torch process checks that both outputs hold the same tensors bit for bit.
`run(gib, base)` returns the figures; `benchmarks/run_all.py` prints them in its table.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floors  # noqa: E402
from import_megatron import median_run  # noqa: E402

HIDDEN, HEADS, FFN, VOCAB = 2048, 16, 5632, 8192
HERE = os.path.abspath(__file__)


def layers_for(gib: float) -> int:
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN) * 4
    rest = gib * 2**30 - 2 * VOCAB * HIDDEN * 4
    return max(1, round(rest / per_layer))


def hf_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "float32",
    }


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{n}.weight"] = (HIDDEN, HIDDEN)
        out[p + "mlp.gate_proj.weight"] = (FFN, HIDDEN)
        out[p + "mlp.up_proj.weight"] = (FFN, HIDDEN)
        out[p + "mlp.down_proj.weight"] = (HIDDEN, FFN)
        out[p + "input_layernorm.weight"] = (HIDDEN,)
        out[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    out["model.norm.weight"] = (HIDDEN,)
    out["lm_head.weight"] = (VOCAB, HIDDEN)
    return out


ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def shard_dim(name: str, layout: str) -> int:
    """The dim `name` is split on over the 2 ranks under `layout` ("fsdp" or "tp")."""
    return 1 if layout == "tp" and name.endswith(ROW_PARALLEL) else 0


def _writer(rank: int, out: str, layers: int, port: int, layout: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1000 + rank)
    sd = {}
    for name, shape in shapes(layers).items():
        dim = shard_dim(name, layout)
        local = tuple(n // 2 if i == dim else n for i, n in enumerate(shape))
        t = torch.randn(*local, generator=g) * 0.02
        sd[name] = DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def write(out: str, layers: int, layout: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_writer, args=(out, layers, port, layout), nprocs=2, start_method="fork")


def torch_consolidate(src: str, dst: str) -> float:
    """`dcp_to_torch_save`, then an fsync of its output (which torch does not do): returns the
    fsync's seconds, so the caller can report torch's time with and without durability."""
    import time

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, dst)
    t0 = time.perf_counter()
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def check_same(torch_file: str, hf_dir: str) -> int:
    """Compare every tensor of the two outputs bitwise; returns the tensor count."""
    import torch
    from safetensors import safe_open

    ref = torch.load(torch_file, mmap=True, weights_only=True)
    names = [f for f in os.listdir(hf_dir) if f.startswith("model") and f.endswith(".safetensors")]
    seen = 0
    for fname in names:
        with safe_open(os.path.join(hf_dir, fname), "pt") as f:
            for k in f.keys():
                if not torch.equal(f.get_tensor(k), ref[k]):
                    raise SystemExit(f"{k}: hybridckpt's output differs from dcp_to_torch_save's")
                seen += 1
    if seen != len(ref):
        raise SystemExit(f"hybridckpt wrote {seen} tensors, torch {len(ref)}")
    return seen


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` under /usr/bin/time: wall seconds and peak RSS (bytes) of that process."""
    p = subprocess.run(
        ["/usr/bin/time", "-f", "TIME %e %M", *cmd], capture_output=True, text=True, env=env
    )
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    line = [x for x in p.stderr.splitlines() if x.startswith("TIME ")][-1]
    _, sec, kib = line.split()
    fsync = [float(x.split()[1]) for x in p.stdout.splitlines() if x.startswith("FSYNC ")]
    return {"seconds": float(sec), "peak_rss": int(kib) * 1024, "fsync_s": fsync[-1] if fsync else 0.0}


def run(gib: float, base: str, *, layout: str = "fsdp", keep: bool = False, repeat: int = 3) -> dict:
    """Write the DCP checkpoint under `base`, then time both consolidations `repeat` times,
    alternating (the median run of each), and check their outputs agree."""
    layers = layers_for(gib)
    os.makedirs(base, exist_ok=True)
    src = os.path.join(base, "dcp")
    cfg = os.path.join(base, "config.json")
    with open(cfg, "w") as f:
        json.dump(hf_config(layers), f)
    subprocess.run([sys.executable, HERE, "--_write", src, str(layers), layout], check=True, capture_output=True)
    nbytes = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    subprocess.run(["sync"], check=True)  # the write's dirty pages flushed before timing anything
    subprocess.run(["cat", *[os.path.join(src, f) for f in os.listdir(src)]], stdout=subprocess.DEVNULL, check=True)
    fl = floors.measure(floors.files_under(src), os.path.join(base, "floor"))
    out_hf, out_pt = os.path.join(base, "hf"), os.path.join(base, "consolidated.pt")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    ours_cmd = [sys.executable, "-m", "hybridckpt.cli", "export", src, out_hf, "--config", cfg, "--quiet"]
    theirs_cmd = [sys.executable, HERE, "--_torch", src, out_pt]
    try:
        runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
        for _ in range(repeat):  # alternate, `sync` between runs (untimed), keep each one's median
            for key, cmd, out in (("ours", ours_cmd, out_hf), ("theirs", theirs_cmd, out_pt)):
                if os.path.isdir(out):
                    shutil.rmtree(out)
                elif os.path.exists(out):
                    os.remove(out)
                subprocess.run(["sync"], check=True)
                runs[key].append(timed(cmd, env))
        ours = median_run(runs["ours"])
        for r in runs["theirs"]:  # torch as users run it: without the fsync we add after it
            r["durable_seconds"], r["seconds"] = r["seconds"], r["seconds"] - r["fsync_s"]
        theirs = median_run(runs["theirs"])
        subprocess.run(["sync"], check=True)
        tensors = int(subprocess.run(
            [sys.executable, HERE, "--_check", out_pt, out_hf], check=True, capture_output=True, text=True
        ).stdout.split()[-1])
    finally:
        if not keep:
            for p in (src, out_hf, out_pt):
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (os.path.exists(p) and os.remove(p))
    return {"gib": gib, "layout": layout, "layers": layers, "bytes": nbytes, "tensors": tensors,
            "hybridckpt": ours, "torch": theirs, "floors": fl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--layout", choices=("fsdp", "tp"), default="fsdp")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--_write", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_torch", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_check", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._write:
        write(a._write[0], int(a._write[1]), a._write[2])
        return
    if a._torch:
        print(f"FSYNC {torch_consolidate(*a._torch)}")
        return
    if a._check:
        print(check_same(*a._check))
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    try:
        print(json.dumps(run(a.gib, base, layout=a.layout, keep=a.keep), indent=1))
    finally:
        if a.dir is None and not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
