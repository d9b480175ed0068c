"""An FP8 block-quantized HF checkpoint imported (dequantized to bfloat16), against the write floor.

    python benchmarks/import_fp8.py [--gib 0.25] [--dir DIR] [--keep]

A synthetic Llama-shaped checkpoint in DeepSeek's FP8 layout (`quantization_config` fp8, 128 x 128
blocks, `weight_scale_inv` float32, an intermediate size of 1400 so the MLP weights end in partial
blocks; embedding, norms and head bfloat16) of about `--gib` GiB of float8 weights is written with
numpy (no torch). A subprocess then runs `hybridckpt import SRC DST` (mesh dp=1; bfloat16, the
default for a quantized source: the store holds twice the float8 bytes) and reports wall seconds
and its peak RSS. The floors (`floors.py`) are measured in the same run: writing the source's
bytes durably, and writing as many bytes as the store holds.
Results: docs/benchmarks-fp8.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import floors
import ml_dtypes
import numpy as np

HIDDEN, INTER, HEADS, KV, VOCAB, BLOCK = 2048, 1400, 16, 8, 32000, 128


def layers_for(gib: float) -> int:
    per = HIDDEN * HIDDEN * 2 + 2 * HIDDEN * (HIDDEN * KV // HEADS) + 3 * HIDDEN * INTER  # fp8 bytes a layer
    return max(1, round(gib * 2**30 / per))


def write(root: str, layers: int) -> int:
    """The checkpoint at `root`, a layer at a time; returns its bytes."""
    from hybridckpt.containers.safetensors_file import write as write_st
    from hybridckpt.lazy import ArrayTensor

    os.makedirs(root, exist_ok=True)
    r = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def fp8(out: int, inp: int) -> dict:
        q = r.integers(0, 0x7E, (out, inp), dtype=np.uint8) | (r.integers(0, 2, (out, inp), dtype=np.uint8) << 7)
        s = (r.random((-(-out // BLOCK), -(-inp // BLOCK))) * 1e-3).astype(np.float32)
        return {"weight": ArrayTensor(q.view(ml_dtypes.float8_e4m3fn)), "weight_scale_inv": ArrayTensor(s)}

    kv = HIDDEN * KV // HEADS
    weight_map, total = {}, 0
    files = [("model-00000.safetensors", {
        "model.embed_tokens.weight": ArrayTensor(r.standard_normal((VOCAB, HIDDEN), np.float32).astype(bf16)),
        "lm_head.weight": ArrayTensor(r.standard_normal((VOCAB, HIDDEN), np.float32).astype(bf16)),
        "model.norm.weight": ArrayTensor(np.ones(HIDDEN, bf16))})]
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": ArrayTensor(np.ones(HIDDEN, bf16)),
             p + "post_attention_layernorm.weight": ArrayTensor(np.ones(HIDDEN, bf16))}
        for name, (o, n) in {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (kv, HIDDEN),
                             "self_attn.v_proj": (kv, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
                             "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
                             "mlp.down_proj": (HIDDEN, INTER)}.items():
            t |= {f"{p}{name}.{k}": v for k, v in fp8(o, n).items()}
        files.append((f"model-{i + 1:05d}.safetensors", t))
    for fname, t in files:
        write_st(os.path.join(root, fname), t, {"format": "pt"})
        weight_map |= {k: fname for k in t}
        total += os.path.getsize(os.path.join(root, fname))
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
           "num_hidden_layers": layers, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [BLOCK, BLOCK]}}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    return total


def run_import(src: str, dst: str) -> dict:
    code = (
        "import json,resource,time,sys\n"
        "from hybridckpt.jobs.import_ import import_checkpoint\n"
        "t=time.perf_counter(); s=import_checkpoint(sys.argv[1], sys.argv[2], mesh='dp=1')\n"
        "print(json.dumps({'seconds': time.perf_counter()-t, 'bytes': s.bytes,"
        " 'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024}))\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run([sys.executable, "-c", code, src, dst], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25, help="GiB of float8 weights")
    ap.add_argument("--dir", help="scratch folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="fp8bench-")
    src, dst = os.path.join(base, "src"), os.path.join(base, "dst")
    try:
        layers = layers_for(a.gib)
        t0 = time.perf_counter()
        nbytes = write(src, layers)
        print(f"wrote {nbytes / 2**30:.2f} GiB ({layers} layers) in {time.perf_counter() - t0:.1f} s")
        row = run_import(src, dst)
        fl = floors.measure(floors.files_under(src), os.path.join(base, "floor"))
        twice = floors.write_floor(floors.files_under(src) * 2, os.path.join(base, "floor2"), row["bytes"])
        print(json.dumps({"source_bytes": nbytes, "layers": layers, **row, "write_floor_source_s": fl["write_s"],
                          "write_floor_store_bytes_s": twice, "read_floor_s": fl["read_s"]}, indent=1))
        print(f"import {row['seconds']:.1f} s = {floors.cell(row['seconds'], twice)} of the floor for the store's bytes")
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
