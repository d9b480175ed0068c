"""Benchmark (f) and the profile of the Orbax write and read paths: import into Orbax and export
out of it, next to the disk's floors, with each codec.

    python benchmarks/orbax_speed.py [--gib 1] [--dir DIR] [--repeat 3] [--only meta|hf]

Sources (about `--gib` GiB each, trained-like weights: normal, each row scaled by 0.02 x a
log-normal factor (sigma 0.5), norms near 1; not uniform noise, whose bytes no codec compresses):
- `meta`: a Meta Llama checkpoint split 2 ways (`consolidated.00.pth`, `consolidated.01.pth`,
  `params.json`), bf16, written rank by rank by `torch.save` in a subprocess;
- `hf`: an HF Llama folder, fp32, in 256 MiB `model-0000N-of-0000M.safetensors` shards with
  their index and `config.json`, written by `safetensors.numpy`.

Each figure comes from its own process (bytecode cached, `floors.cached_bytecode`), page cache
warm (every file read once first; the imported checkpoints too before they are exported: a raw
import writes with O_DIRECT, past the page cache):
- read floor: `cat` of the source files to /dev/null;
- write floors (`benchmarks/floors.py`): the same bytes copied file to file (`copy_file_range`,
  through the page cache) and fsync'd, and the same bytes written with `O_DIRECT` from aligned
  buffers and fsync'd (how our jobs write): what any converter that writes them durably pays at
  least;
- import onto tp=4,pp=2 of 8 CPU devices with `--compression none` (the default) and `zstd`
  (Orbax's default codec): wall seconds, peak RSS, bytes on disk (so the compression ratio);
- the profile of one import: `read+cast` (the reader pool filling tiles, summed over threads),
  and the same import with nothing written (the tiles read, cast and checksummed, then dropped):
  what is left of the import's wall time is TensorStore's encode + write + fsync and Orbax's
  metadata, measured by the two codecs' difference and the write floor;
- export of each imported checkpoint to one HF safetensors folder (transposing the kernels
  back to `[out, in]`): wall seconds, peak RSS, and a read-only pass over the same tensors; the
  raw one also with its reads unchecked (`verify_reads=False`), next to the checked one: the
  median of their ratios is what checking every chunk's CRC-32 costs (`crc_cost`);
- a hand-written peer, the Orbax reference (the hf source only: what a user scripts without
  us): `safetensors.numpy.load_file` + `jax.device_put` on the same mesh + an Orbax save, with
  Orbax's defaults (`StandardCheckpointer().save`: OCDBT, zstd level 1) and raw
  (`PyTreeCheckpointer(use_ocdbt=False, use_compression=False)`: a file per chunk, uncompressed,
  the format a raw import writes); both as durable as the import (TensorStore fsyncs every file
  it writes, `file_io_sync`; Orbax renames the finished folder into place).

Every figure is the median of `repeat` alternating runs (with the highest peak RSS of them); the
floors are the fastest of theirs.

`run(kind, gib, base)` returns the figures; `benchmarks/run_all.py` prints them as rows (f).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

import floors  # noqa: E402
from import_megatron import cat_seconds, median_run, peak_rss  # noqa: E402

MESH = "tp=4,pp=2"
DIM, HEADS, KV, VOCAB = 2048, 16, 8, 32000  # meta (bf16)
HF_DIM, HF_HEADS, HF_KV, HF_FFN = 1024, 16, 8, 2816  # hf (fp32)
SHARD_BYTES = 256 << 20


def meta_ffn(dim: int, multiple_of: int = 256) -> int:
    """Meta's FeedForward width (meta-llama/llama:llama/model.py): 2/3 of 4 x dim, rounded up."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def trained_like(rng, shape, dtype):
    """Normal weights, each row scaled by 0.02 x exp(N(0, 0.5)): a trained matrix's spread."""
    import numpy as np

    rows = shape[0]
    scale = (0.02 * np.exp(rng.normal(0.0, 0.5, (rows,) + (1,) * (len(shape) - 1)))).astype(np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def norm_like(rng, n, dtype):
    import numpy as np

    return (1.0 + 0.05 * rng.standard_normal(n, dtype=np.float32)).astype(dtype)


def meta_layers(gib: float) -> int:
    hd = DIM // HEADS
    per_layer = 2 * (DIM * HEADS * hd + 2 * DIM * KV * hd + 3 * DIM * meta_ffn(DIM))
    return max(2, round((gib * 2**30 - 2 * 2 * VOCAB * DIM) / per_layer / 2) * 2)


def write_meta(root: str, layers: int) -> None:
    """Meta's layout (formats/meta_llama.py): wq/wk/wv/w1/w3/output split on dim 0, wo/w2 on
    dim 1, tok_embeddings on dim 1 (ParallelEmbedding), norms replicated; one rank in memory."""
    import ml_dtypes
    import numpy as np
    import torch

    hd, ffn, mp = DIM // HEADS, meta_ffn(DIM), 2
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "params.json"), "w") as f:
        json.dump({"dim": DIM, "n_layers": layers, "n_heads": HEADS, "n_kv_heads": KV, "vocab_size": VOCAB,
                   "multiple_of": 256, "norm_eps": 1e-5, "rope_theta": 10000.0}, f)
    bf = ml_dtypes.bfloat16

    def t(x):
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)

    for r in range(mp):
        rng = np.random.default_rng(r)
        sd = {"tok_embeddings.weight": t(trained_like(rng, (VOCAB, DIM // mp), bf)),
              "norm.weight": t(norm_like(np.random.default_rng(99), DIM, bf)),
              "output.weight": t(trained_like(rng, (VOCAB // mp, DIM), bf))}
        for i in range(layers):
            p = f"layers.{i}."
            sd[p + "attention.wq.weight"] = t(trained_like(rng, (HEADS * hd // mp, DIM), bf))
            sd[p + "attention.wk.weight"] = t(trained_like(rng, (KV * hd // mp, DIM), bf))
            sd[p + "attention.wv.weight"] = t(trained_like(rng, (KV * hd // mp, DIM), bf))
            sd[p + "attention.wo.weight"] = t(trained_like(rng, (DIM, HEADS * hd // mp), bf))
            sd[p + "feed_forward.w1.weight"] = t(trained_like(rng, (ffn // mp, DIM), bf))
            sd[p + "feed_forward.w2.weight"] = t(trained_like(rng, (DIM, ffn // mp), bf))
            sd[p + "feed_forward.w3.weight"] = t(trained_like(rng, (ffn // mp, DIM), bf))
            g = np.random.default_rng(1000 + i)  # replicated: the same on every rank
            sd[p + "attention_norm.weight"] = t(norm_like(g, DIM, bf))
            sd[p + "ffn_norm.weight"] = t(norm_like(g, DIM, bf))
        torch.save(sd, os.path.join(root, f"consolidated.{r:02d}.pth"))
        del sd


def set_hf_width(hidden: int) -> None:
    """The HF Llama's widths from its hidden size: `hidden`, SwiGLU 11/4 of it (2816 for 1024,
    5632 for 2048: 1B widths, the DCP sources' of `import_sources_floor`), 16 heads, 8 KV heads."""
    global HF_DIM, HF_FFN, HF_HEADS, HF_KV
    if hidden < 64 or hidden % 64:
        raise SystemExit(f"--hidden {hidden}: expected a multiple of 64 (16 heads of a whole multiple of 4)")
    HF_DIM, HF_FFN, HF_HEADS, HF_KV = hidden, 11 * hidden // 4, 16, 8


def hf_layers(gib: float) -> int:
    hd = HF_DIM // HF_HEADS
    per_layer = 4 * (2 * HF_DIM * HF_HEADS * hd + 2 * HF_DIM * HF_KV * hd + 3 * HF_DIM * HF_FFN)
    return max(2, round((gib * 2**30 - 4 * 2 * VOCAB * HF_DIM) / per_layer / 2) * 2)


def write_hf(root: str, layers: int) -> None:
    """An HF Llama folder in fp32 safetensors shards of about SHARD_BYTES, with its index."""
    import numpy as np
    from safetensors.numpy import save_file

    hd = HF_DIM // HF_HEADS
    os.makedirs(root, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HF_DIM,
           "intermediate_size": HF_FFN, "num_hidden_layers": layers, "num_attention_heads": HF_HEADS,
           "num_key_value_heads": HF_KV, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32",
           "hidden_act": "silu"}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    rng = np.random.default_rng(0)
    f32 = np.float32
    names: list[tuple[str, tuple, bool]] = [("model.embed_tokens.weight", (VOCAB, HF_DIM), False)]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (HF_DIM,), True),
                  (p + "self_attn.q_proj.weight", (HF_HEADS * hd, HF_DIM), False),
                  (p + "self_attn.k_proj.weight", (HF_KV * hd, HF_DIM), False),
                  (p + "self_attn.v_proj.weight", (HF_KV * hd, HF_DIM), False),
                  (p + "self_attn.o_proj.weight", (HF_DIM, HF_HEADS * hd), False),
                  (p + "post_attention_layernorm.weight", (HF_DIM,), True),
                  (p + "mlp.gate_proj.weight", (HF_FFN, HF_DIM), False),
                  (p + "mlp.up_proj.weight", (HF_FFN, HF_DIM), False),
                  (p + "mlp.down_proj.weight", (HF_DIM, HF_FFN), False)]
    names += [("model.norm.weight", (HF_DIM,), True), ("lm_head.weight", (VOCAB, HF_DIM), False)]
    shards: list[dict] = [{}]
    size = 0
    for name, shape, is_norm in names:
        n = math.prod(shape) * 4
        if size and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = shape, is_norm
        size += n
    index = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {n: norm_like(rng, s[0], f32) if is_norm else trained_like(rng, s, f32) for n, (s, is_norm) in shard.items()}
        save_file(data, os.path.join(root, fname), metadata={"format": "pt"})
        index |= dict.fromkeys(shard, fname)
        del data
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)


def files_of(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def disk_bytes(root: str) -> int:
    return sum(os.path.getsize(p) for p in files_of(root))


# -- children (each in its own process) ----------------------------------------------------------


def _devices() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"


def child_import(src: str, dst: str, compression: str, profile: str) -> dict:
    """The streaming import; with `profile` "1", reader-thread seconds are summed too."""
    _devices()
    from hybridckpt import jobs
    from hybridckpt.store import stream

    read_s = [0.0]
    if profile == "1":
        inner = stream.read_tile

        def timed(leaf, box, chunk, *rest):
            t = time.perf_counter()
            try:
                return inner(leaf, box, chunk, *rest)
            finally:
                read_s[0] += time.perf_counter() - t

        stream.read_tile = timed
    t0 = time.perf_counter()
    s = jobs.import_checkpoint(src, dst, mesh=MESH, params_only=True, compression=compression, overwrite=True)
    return {"seconds": time.perf_counter() - t0, "bytes": s.bytes, "peak_rss": peak_rss(), "read_cast_s": read_s[0]}


def child_read_only(src: str) -> dict:
    """Every tile an import onto MESH would write, read and cast (and checksummed), then dropped."""
    _devices()
    from hybridckpt import jobs, lazy, naming, plan
    from hybridckpt.lazy import parallel
    from hybridckpt.mesh import mesh_from_shape
    from hybridckpt.naming import flatten
    from hybridckpt.store import stream

    t0 = time.perf_counter()
    opened = jobs.open_checkpoint(src)
    named = naming.hf_to_tree(opened.named, opened.config)
    p = plan.for_model(opened.config, mesh_from_shape(MESH))
    shard, axes = flatten(p.param_shardings), flatten(p.chunk_axes)
    futures = []
    for k, t in named.params.items():
        leaf = stream.LazyLeaf(lazy.as_lazy(t), shard[k], k, tuple(axes.get(k, ())))
        chunk = stream.chunk_shape(leaf)
        for box in stream.owned_boxes(leaf.shape, leaf.sharding):
            for tile in stream.plan_tiles(box, chunk, leaf.dtype.itemsize, stream.TILE_BYTES):
                futures.append(parallel.pool().submit(stream.read_tile, leaf, tile, chunk))
        while len(futures) > 8:
            futures.pop(0).result()
    for f in futures:
        f.result()
    return {"seconds": time.perf_counter() - t0, "peak_rss": peak_rss()}


def child_export(src: str, out: str, verify: str = "1") -> dict:
    from hybridckpt import jobs

    t0 = time.perf_counter()
    jobs.export_checkpoint(src, out, overwrite=True, verify_reads=verify == "1")
    return {"seconds": time.perf_counter() - t0, "peak_rss": peak_rss()}


def child_export_read(src: str) -> dict:
    """The export's reads alone: every HF tensor of the checkpoint read (transposed) into a buffer."""
    import numpy as np

    from hybridckpt import jobs, naming

    t0 = time.perf_counter()
    opened = jobs.open_checkpoint(src)
    for t in naming.model_hf(opened.named, opened.config).params.values():
        buf = np.empty(t.shape, t.dtype)
        t.read_into(tuple((0, n) for n in t.shape), buf)
    return {"seconds": time.perf_counter() - t0, "peak_rss": peak_rss()}


def child_peer(src: str, dst: str, codec: str = "zstd") -> dict:
    """The hand-written peer: `safetensors.numpy.load_file` of every shard, each tensor
    `jax.device_put` on the 8 devices (split on dim 0 where it divides, else replicated), then
    Orbax's `StandardCheckpointer().save` (`codec` "zstd": OCDBT + zstd, Orbax's defaults) or
    `PyTreeCheckpointer(use_ocdbt=False, use_compression=False)` ("raw"): what a user scripts
    without a converter."""
    _devices()
    shutil.rmtree(dst, ignore_errors=True)
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors.numpy import load_file

    t0 = time.perf_counter()
    mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    arrays = {}
    for f in files_of(src):
        if f.endswith(".safetensors"):
            for k, v in load_file(f).items():
                spec = P("x") if v.shape and v.shape[0] % len(jax.devices()) == 0 else P()
                arrays[k.replace(".", "/")] = jax.device_put(v, NamedSharding(mesh, spec))
    if codec == "raw":
        with ocp.PyTreeCheckpointer(use_ocdbt=False, use_compression=False) as ckptr:
            ckptr.save(os.path.abspath(dst), args=ocp.args.PyTreeSave(arrays))
    else:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.abspath(dst), arrays)
    return {"seconds": time.perf_counter() - t0, "peak_rss": peak_rss()}


CHILDREN = {"import": child_import, "read_only": child_read_only, "export": child_export,
            "export_read": child_export_read, "peer": child_peer}


def _child(kind: str, *argv: str) -> dict:
    out = subprocess.run([sys.executable, HERE, "--_child", kind, *argv], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(kind: str, gib: float, base: str, *, repeat: int = 2, peer: bool = True) -> dict:
    """Write the `kind` source ("meta" or "hf") under `base`, then measure (module doc); the
    figures of each step are the median of `repeat` runs, alternating, with the highest RSS; the
    floors the fastest of theirs."""
    src = os.path.join(base, f"{kind}_src")
    shutil.rmtree(src, ignore_errors=True)
    layers = meta_layers(gib) if kind == "meta" else hf_layers(gib)
    subprocess.run([sys.executable, HERE, "--_write", kind, src, str(layers)], check=True)
    files = [f for f in files_of(src) if f.endswith((".pth", ".safetensors"))]
    r: dict = {"kind": kind, "layers": layers, "files_bytes": sum(os.path.getsize(f) for f in files)}
    dst = {c: os.path.join(base, f"{kind}_orbax_{c}") for c in ("none", "zstd")}
    out = os.path.join(base, f"{kind}_hf_out")
    runs: dict[str, list] = {k: [] for k in ("read", "write", "import_none", "import_zstd", "read_only",
                                           "export_none", "export_zstd", "export_read", "export_unchecked", "peer",
                                           "peer_raw", "write_direct")}
    direct_note = ""
    try:
        subprocess.run(["sync"], check=True)
        cat_seconds(files)  # warm
        for _ in range(repeat):
            runs["read"].append({"seconds": cat_seconds(files), "peak_rss": 0})
            runs["write"].append({"seconds": floors.write_floor(files, os.path.join(base, "floor")), "peak_rss": 0})
            secs, direct_note = floors.direct_write_floor(files, os.path.join(base, "floor"))
            if secs is not None:
                runs["write_direct"].append({"seconds": secs, "peak_rss": 0})
            for c in ("none", "zstd"):
                shutil.rmtree(dst[c], ignore_errors=True)
                subprocess.run(["sync"], check=True)
                runs[f"import_{c}"].append(_child("import", src, dst[c], c, "1"))
            runs["read_only"].append(_child("read_only", src))
            for c in ("none", "zstd"):
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                cat_seconds(files_of(dst[c]))  # warm, as every source here (a raw import bypassed the page cache)
                runs[f"export_{c}"].append(_child("export", dst[c], out))
            shutil.rmtree(out, ignore_errors=True)  # the same export with its reads unchecked (no CRC)
            subprocess.run(["sync"], check=True)
            runs["export_unchecked"].append(_child("export", dst["none"], out, "0"))
            runs["export_read"].append(_child("export_read", dst["none"]))
            if peer and kind == "hf":
                peer_dst = os.path.join(base, "peer")
                shutil.rmtree(peer_dst, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                for codec in ("zstd", "raw"):
                    subprocess.run(["sync"], check=True)
                    runs["peer" if codec == "zstd" else "peer_raw"].append(_child("peer", src, peer_dst, codec))
                    shutil.rmtree(peer_dst, ignore_errors=True)
        r |= {k: median_run(v) for k, v in runs.items() if v}
        fastest = {k: min(x["seconds"] for x in runs[k]) if runs[k] else None for k in ("write", "write_direct", "read")}
        r["floors"] = {"write_s": fastest["write"], "write_direct_s": fastest["write_direct"],
                       "direct_note": direct_note, "read_s": fastest["read"]}
        # what checking every chunk's CRC-32 costs an export: the median over repeats of the
        # checked export's time over the unchecked one's, run next to each other
        pairs = sorted(a["seconds"] / b["seconds"] for a, b in zip(runs["export_none"], runs["export_unchecked"], strict=True))
        r["crc_cost"] = pairs[len(pairs) // 2] - 1
        r["orbax_bytes"] = {c: disk_bytes(os.path.join(dst[c])) for c in dst}
        r["array_bytes"] = r["import_none"]["bytes"]
        r["export_bytes"] = disk_bytes(out)
    finally:
        for p in (src, out, *dst.values()):
            shutil.rmtree(p, ignore_errors=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("meta", "hf"))
    ap.add_argument("--_write", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_hf_hidden", type=int, default=HF_DIM, help=argparse.SUPPRESS)  # (`set_hf_width`)
    ap.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._write:
        set_hf_width(a._hf_hidden)
        (write_meta if a._write[0] == "meta" else write_hf)(a._write[1], int(a._write[2]))
        return
    if a._child:
        print(json.dumps(CHILDREN[a._child[0]](*a._child[1:])))
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    floors.cached_bytecode(base)
    try:
        for kind in (a.only,) if a.only else ("meta", "hf"):
            print(json.dumps(run(kind, a.gib, base, repeat=a.repeat), indent=1))
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
