"""Peak host memory of a Megatron import, tensor by tensor, for two checkpoint sizes.

    python benchmarks/import_memory.py [--sizes 0.5 2] [--dir DIR] [--keep]

For each size (GiB of bf16 weights) a synthetic Llama-like Megatron checkpoint (mcore names,
tp=2, pp=2, GQA, SwiGLU, no optimizer; written by import_megatron.py's writer) is written with
torch in one subprocess;
a second subprocess (torch never imported) opens it with `hybridckpt.formats.registry.open_source`, maps
it to HF names with its `hf_rules`, then materialises one HF tensor at a time and drops it.
Printed per size: checkpoint bytes, largest HF tensor (bytes), peak RSS after `open` and after
the whole import (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, the process's high-water mark),
and the read throughput (GB/s, page cache warm from the write). The invariant to check: peak
RSS grows with the largest tensor, not with the checkpoint size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import import_megatron  # benchmarks/import_megatron.py: the synthetic Megatron writer

# the synthetic Megatron writer is import_megatron's (same folder), at tp 2 x pp 2 here
TP, PP = 2, 2


def layers_for(gib: float) -> int:
    """Layers (a multiple of PP) so that the bf16 weights are about `gib` GiB."""
    return import_megatron.layers_for(gib, tp=TP, pp=PP)


def write(root: str, layers: int) -> None:
    """Write the checkpoint rank by rank (only one rank's tensors in memory at a time)."""
    import_megatron.write(root, layers, tp=TP, pp=PP)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_import(root: str) -> dict:
    """Open, map to HF names, materialise tensor by tensor; memory and speed figures."""
    from hybridckpt.formats.registry import open_source
    from hybridckpt.rules import parse_rules

    t0 = time.perf_counter()
    src = open_source(root)
    hf = parse_rules(src.hf_rules, src.rule_vars).apply(src.tensors).tensors
    rss_open = _rss_mib()
    total = largest = 0
    t1 = time.perf_counter()
    for _, t in hf.items():
        a = t.materialize()
        total += a.nbytes
        largest = max(largest, a.nbytes)
        del a
    t2 = time.perf_counter()
    return {
        "hf_tensors": len(hf),
        "bytes": total,
        "largest_tensor_bytes": largest,
        "peak_rss_after_open_mib": round(rss_open, 1),
        "peak_rss_mib": round(_rss_mib(), 1),
        "open_s": round(t1 - t0, 2),
        "read_s": round(t2 - t1, 2),
        "gb_per_s": round(total / (t2 - t1) / 1e9, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sizes", type=float, nargs="+", default=[0.5, 2.0], help="GiB of bf16 weights"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--_write", nargs=2, metavar=("ROOT", "LAYERS"), help=argparse.SUPPRESS)
    ap.add_argument("--_import", metavar="ROOT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._write:
        write(a._write[0], int(a._write[1]))
        return
    if a._import:
        print(json.dumps(run_import(a._import)))
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-")
    here = os.path.abspath(__file__)
    try:
        for gib in a.sizes:
            layers = layers_for(gib)
            root = os.path.join(base, f"megatron_{gib}g")
            os.makedirs(root, exist_ok=True)
            subprocess.run([sys.executable, here, "--_write", root, str(layers)], check=True)
            out = (
                subprocess.run(
                    [sys.executable, here, "--_import", root],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            r = json.loads(out)
            print(
                f"{gib:>4} GiB  tp={TP} pp={PP} layers={layers}: {r['hf_tensors']} HF tensors, "
                f"{r['bytes'] / 2**30:.2f} GiB read at {r['gb_per_s']} GB/s; largest tensor "
                f"{r['largest_tensor_bytes'] / 2**20:.0f} MiB; peak RSS {r['peak_rss_after_open_mib']:.0f} MiB "
                f"after open, {r['peak_rss_mib']:.0f} MiB after the import",
                flush=True,
            )
            if not a.keep:
                shutil.rmtree(root)
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
