"""Benchmark (b): import a synthetic Megatron-LM checkpoint (tp=4, pp=2) into Orbax, streaming.

    python benchmarks/import_megatron.py [--gib 1] [--mesh tp=4,pp=2] [--dir DIR] [--keep]

The checkpoint (mcore names, Llama-like: GQA, SwiGLU, padded vocab, untied head, bf16, no
optimizer) is written rank by rank with torch in a subprocess. Then, each in its own
subprocess (torch never imported there), with the page cache warm from the write:

- `cat` of every checkpoint file to /dev/null (the read floor);
- `hybridckpt.jobs.import_checkpoint` (the streaming import) onto `--mesh` of 8 simulated
  CPU devices: seconds, GB/s of checkpoint bytes, peak RSS (`ru_maxrss`);
- two references, each the same arrays materialised as jax.Arrays on the same mesh (untimed),
  then saved from memory (timed): seconds and peak RSS:
  - "zstd": `save_checkpoint` of them, i.e. Orbax's defaults (OCDBT, zarr chunks compressed with
    zstd level 1), as a training loop saves;
  - "raw": plain Orbax, `PyTreeCheckpointer(use_ocdbt=False, use_compression=False)`: a zarr
    folder per array and a file per chunk, uncompressed, the format our raw import writes.
  Both are as durable as the import: TensorStore's file driver fsyncs every file it writes
  (`file_io_sync`, on by default) and Orbax renames the finished step into place.

Every figure is the median of `repeat` alternating runs (the highest peak RSS of them).

`run(gib)` returns the figures as a dict; `benchmarks/run_all.py` prints them in its table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HIDDEN, HEADS, KV, FFN, VOCAB = 2048, 16, 8, 5632, 32000
TP, PP = 4, 2
MESH = "tp=4,pp=2"
HERE = os.path.abspath(__file__)


def padded_vocab(tp: int = TP) -> int:
    return math.ceil(VOCAB / (128 * tp)) * 128 * tp


def layers_for(gib: float, tp: int = TP, pp: int = PP) -> int:
    """Layers (a multiple of pp) so that the bf16 weights are about `gib` GiB."""
    hd = HIDDEN // HEADS
    per_layer = (HEADS + 2 * KV) * hd * HIDDEN + HIDDEN * HEADS * hd + 3 * FFN * HIDDEN + 2 * HIDDEN
    rest = gib * 2**30 / 2 - 2 * padded_vocab(tp) * HIDDEN
    return max(pp, round(rest / per_layer / pp) * pp)


def write(root: str, layers: int, tp: int = TP, pp: int = PP) -> None:
    """Write the checkpoint rank by rank (one rank's tensors in memory at a time)."""
    import argparse as ap

    import torch

    hd = HIDDEN // HEADS
    padded = padded_vocab(tp)
    it = os.path.join(root, "iter_0000010")
    os.makedirs(it, exist_ok=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")
    args = ap.Namespace(
        num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        kv_channels=hd, group_query_attention=True, num_query_groups=KV,
        max_position_embeddings=4096, position_embedding_type="rope", rotary_base=10000,
        normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        untie_embeddings_and_output_weights=True, padded_vocab_size=padded, vocab_size=VOCAB,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, data_parallel_size=1,
        params_dtype=torch.bfloat16, use_distributed_optimizer=False,
    )
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    per_stage = layers // pp
    for p in range(pp):
        for r in range(tp):
            sd = {}
            if p == 0:
                sd["embedding.word_embeddings.weight"] = rnd(padded // tp, HIDDEN)
            for j in range(per_stage):
                pre = f"decoder.layers.{j}."
                sd[pre + "self_attention.linear_proj.weight"] = rnd(HIDDEN, HEADS * hd // tp)
                sd[pre + "self_attention.linear_qkv.layer_norm_weight"] = ones(HIDDEN)
                sd[pre + "self_attention.linear_qkv.weight"] = rnd((HEADS + 2 * KV) * hd // tp, HIDDEN)
                sd[pre + "mlp.linear_fc1.layer_norm_weight"] = ones(HIDDEN)
                sd[pre + "mlp.linear_fc1.weight"] = rnd(2 * FFN // tp, HIDDEN)
                sd[pre + "mlp.linear_fc2.weight"] = rnd(HIDDEN, FFN // tp)
            if p == pp - 1:
                sd["decoder.final_layernorm.weight"] = ones(HIDDEN)
                sd["output_layer.weight"] = rnd(padded // tp, HIDDEN)
            d = os.path.join(it, f"mp_rank_{r:02d}_{p:03d}")
            os.makedirs(d, exist_ok=True)
            torch.save(
                {"args": args, "checkpoint_version": 3.0, "iteration": 10, "model": sd},
                os.path.join(d, "model_optim_rng.pt"),
            )
            del sd


def files_of(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".pt"))


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM (ru_maxrss would include the RSS of the parent
    that forked it)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _devices() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"


def child_import(src: str, dst: str, mesh: str) -> dict:
    """In a fresh process: the streaming import, timed from the call."""
    _devices()
    from hybridckpt import jobs
    from hybridckpt.store.stream import StreamOptions

    opts = StreamOptions()
    t0 = time.perf_counter()
    s = jobs.import_checkpoint(src, dst, mesh=mesh, params_only=True, stream_options=opts)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes": s.bytes, "tensors": s.tensors, "peak_rss": peak_rss(),
            "peak_inflight": opts.stats.peak_inflight_bytes, "largest_tile": opts.stats.largest_tile_bytes}


def child_save(src: str, dst: str, mesh: str, codec: str = "zstd") -> dict:
    """In a fresh process: the same arrays materialised on `mesh` (untimed), then Orbax's save
    of them from memory (timed): `codec` "zstd" through `save_checkpoint` (OCDBT + zstd, Orbax's
    defaults), "raw" with plain Orbax without OCDBT or compression (module doc)."""
    _devices()
    import jax

    from hybridckpt import jobs, models, naming, place
    from hybridckpt.mesh import mesh_from_shape, tree_shardings
    from hybridckpt.store import save_checkpoint

    opened = jobs.open_checkpoint(src)
    cfg = opened.config
    tree = naming.hf_to_tree(opened.named, cfg)
    jmesh = mesh_from_shape(mesh)
    shard = tree_shardings(models.param_shapes(cfg), models.logical_axes(cfg), jmesh)
    params = place.assemble(naming.nest(tree.params), shard)
    jax.block_until_ready(params)
    rss_before = peak_rss()
    t0 = time.perf_counter()
    if codec == "raw":
        import orbax.checkpoint as ocp

        with ocp.PyTreeCheckpointer(use_ocdbt=False, use_compression=False) as ckptr:
            ckptr.save(os.path.abspath(dst), args=ocp.args.PyTreeSave(params))
    else:
        save_checkpoint(dst, 10, params, None, {"bench": True})
    dt = time.perf_counter() - t0
    return {"seconds": dt, "peak_rss": peak_rss(), "rss_with_arrays": rss_before}


def cat_seconds(paths: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)  # read(2)s of 128 KiB
    return time.perf_counter() - t0


def _child(kind: str, *argv: str) -> dict:
    out = subprocess.run(
        [sys.executable, HERE, f"--_{kind}", *argv], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_run(runs: list[dict]) -> dict:
    """The run of median time (of an even count, the upper middle one: the slower of the two), with
    the highest peak RSS of all runs and every run's seconds."""
    mid = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
    mid["peak_rss"] = max(r["peak_rss"] for r in runs)
    mid["runs"] = [round(r["seconds"], 2) for r in runs]
    return mid


def run(
    gib: float, base: str, *, mesh: str = MESH, reference: bool = True, keep: bool = False,
    keep_import: bool = False, repeat: int = 1,
) -> dict:
    """Write a checkpoint of about `gib` GiB under `base`, then measure cat / import / both saves
    (`repeat` times each, alternating: the median time, the highest RSS). `keep` keeps the
    source, `keep_import` the imported checkpoint (paths in the result)."""
    layers = layers_for(gib)
    src = os.path.join(base, f"megatron_{gib:g}g")
    os.makedirs(src, exist_ok=True)
    subprocess.run([sys.executable, HERE, "--_write", src, str(layers)], check=True)
    files = files_of(src)
    src_bytes = sum(os.path.getsize(f) for f in files)
    try:
        subprocess.run(["sync"], check=True)  # the write's dirty pages flushed before any timing
        cat_seconds(files)  # warm the page cache the same way for every reader
        t_cat = min(cat_seconds(files) for _ in range(2))
        import floors

        fl = floors.measure(files, os.path.join(base, f"floor_{gib:g}g"))
        dst = os.path.join(base, f"orbax_{gib:g}g")
        ref_dst = os.path.join(base, f"orbax_ref_{gib:g}g")
        imports, saves, raws = [], [], []
        for _ in range(repeat):  # alternate import / reference saves; median time, worst RSS
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)  # untimed: no earlier writeback in the way
            imports.append(_child("import", src, dst, mesh))
            if reference:
                for codec, out in (("zstd", saves), ("raw", raws)):
                    subprocess.run(["sync"], check=True)
                    out.append(_child("save", src, ref_dst, mesh, codec))
                    shutil.rmtree(ref_dst, ignore_errors=True)
        imp = median_run(imports)
        ref = median_run(saves) if saves else None
        raw = median_run(raws) if raws else None
        if not keep_import:
            shutil.rmtree(dst, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(src, ignore_errors=True)
    return {"gib": gib, "layers": layers, "files_bytes": src_bytes, "cat_s": t_cat, "import": imp,
            "save": ref, "save_raw": raw, "src": src, "imported": dst, "floors": fl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--mesh", default=MESH)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the Orbax-from-memory save")
    ap.add_argument("--_write", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_import", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_save", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._write:
        write(a._write[0], int(a._write[1]))
        return
    if a._import:
        print(json.dumps(child_import(*a._import)))
        return
    if a._save:
        print(json.dumps(child_save(*a._save)))
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    try:
        print(json.dumps(run(a.gib, base, mesh=a.mesh, reference=not a.no_reference, keep=a.keep), indent=1))
    finally:
        if a.dir is None and not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
