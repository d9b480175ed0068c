"""Import from a local S3 server (moto) by byte ranges vs from local disk vs the naive path.

    python benchmarks/remote_import.py [--runs 3] [--mesh fsdp=2,tp=2] [--layers 2]

A tiny-to-small Llama (transformers' `save_pretrained(max_shard_size="20MB")`: several shards,
fp32) is written once and uploaded to a moto server on 127.0.0.1 (tests/fixtures/s3_server.py).
Three ways to the same Orbax checkpoint, each run in a fresh process (`hybridckpt import --json`),
alternated, `--runs` times:

- **disk**: `hybridckpt import LOCAL ckpt`;
- **ranged**: `hybridckpt import s3://bench/hf ckpt` (this work: the prefix listed, metadata
  fetched, data read by coalesced ranged GETs);
- **naive**: every object downloaded first (`fsspec.get`, recursive), then the disk import.

Printed: the median wall seconds of each; the GETs and bytes asked of the server (ranged: the
import summary's `requests`; naive: one GET per object, every byte); per device, the requests and
bytes `import --plan` gives (each device's reads alone); and the machine's load average, since
the timed figures are of a shared machine. The counts are exact; the seconds are indicative.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from fixtures import remote_sources, s3_server  # noqa: E402


def write_source(out: str, layers: int) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size="20MB")
    return out


def hybridckpt(*argv: str, env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hybridckpt", *argv], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"hybridckpt {' '.join(argv)} failed: {done.stderr.strip()}")
    return time.perf_counter() - t0, json.loads(done.stdout)


def naive(url: str, tmp: str, mesh: str, env: dict) -> float:
    """Download every object with fsspec, then import from disk: wall seconds of both."""
    code = ("import fsspec,os,sys; fs=fsspec.filesystem('s3', client_kwargs={'endpoint_url': os.environ['AWS_ENDPOINT_URL']});"
            "fs.get(sys.argv[1] + '/', sys.argv[2] + '/', recursive=True)")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, url, os.path.join(tmp, "down")], env=env, check=True)
    hybridckpt("import", os.path.join(tmp, "down"), os.path.join(tmp, "naive"), "--mesh", mesh, "--json", env=env)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mesh", default="fsdp=2,tp=2")
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="remote-bench-")
    server = s3_server.start()
    try:
        local = write_source(os.path.join(tmp, "hf"), a.layers)
        env = {**os.environ, **server.env(), "PYTHONPATH": ROOT}
        os.environ.update(server.env())
        url = remote_sources.in_bucket(server, local, bucket="bench")
        files = sorted(os.listdir(local))
        total = sum(os.path.getsize(os.path.join(local, f)) for f in files)
        times: dict[str, list[float]] = {"disk": [], "ranged": [], "naive": []}
        asked = {}
        for _ in range(a.runs):
            for way in times:
                for d in ("ckpt", "naive", "down"):
                    shutil.rmtree(os.path.join(tmp, d), ignore_errors=True)
                if way == "naive":
                    times[way].append(naive(url, tmp, a.mesh, env))
                    continue
                src = local if way == "disk" else url
                s, summary = hybridckpt("import", src, os.path.join(tmp, "ckpt"), "--mesh", a.mesh, "--json", env=env)
                times[way].append(s)
                if way == "ranged":
                    asked = summary["requests"]
        _, plan = hybridckpt("import", url, os.path.join(tmp, "ckpt"), "--mesh", a.mesh, "--plan", "--json", env=env)
        host = next(iter(asked))
        load = os.getloadavg()
        print(f"source: HF Llama, {len(files)} files, {total / 1e6:.1f} MB fp32; mesh {a.mesh}; {a.runs} runs each, "
              f"alternated, each a fresh process; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
              f"on {os.cpu_count()} CPUs")
        print(f"{'way':<8}{'median s':>10}{'GETs':>8}{'MB asked':>10}")
        print(f"{'disk':<8}{statistics.median(times['disk']):>10.2f}{'-':>8}{'-':>10}")
        print(f"{'ranged':<8}{statistics.median(times['ranged']):>10.2f}{asked[host]['requests']:>8}"
              f"{asked[host]['bytes'] / 1e6:>10.1f}")
        print(f"{'naive':<8}{statistics.median(times['naive']):>10.2f}{len(files) + 1:>8}{total / 1e6:>10.1f}")
        print("per device (import --plan: each device's reads alone):")
        for d in plan["devices"]:
            r = d["requests"].get(host, {"requests": 0, "bytes": 0})
            print(f"  device {d['device']}: {r['requests']} GETs, {r['bytes'] / 1e6:.2f} MB "
                  f"for {d['bytes_read'] / 1e6:.2f} MB read")
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
