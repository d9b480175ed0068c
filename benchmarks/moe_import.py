"""Benchmark (g): importing an MoE checkpoint reads each expert's bytes once, and its peak
memory stays bounded by the tiles in flight.

    python benchmarks/moe_import.py [--gib 1] [--experts 32] [--mesh dp=4,fsdp=2] [--dir DIR]

Sources: `benchmarks/moe_sources.py` (HF per-expert keys, transformers 5's grouped tensors, a
torchtitan DCP; fp32, trained-like values).

Each is imported (`jobs.import_checkpoint`, what `hybridckpt import` runs, params only) onto
`dp=4,fsdp=2` on 8 CPU devices: experts split over dp (4 x 8), their embed axis over fsdp, so
every expert is cut in two boxes written by two devices. Measured in the import's own process:

- **read ratio**: every call of `ByteSource.read_into` / `copy_to` / `read_span` / `read_runs` /
  `read_scatter` (the doors through which hybridckpt reads checkpoint bytes,
  `hybridckpt/io/byte_source.py`; `recording`) is recorded with its file, offset and length (a
  span or batch of runs records its runs: its gaps are under a page each or read into a scratch
  buffer, and counted apart as gap bytes); the bytes of those reads that fall inside the expert tensors' data ranges
  (`moe_sources.expert_ranges`) over the expert tensors' bytes. 1.00 with every expert byte
  covered = each expert byte read exactly once. (Counting per file, as `count_reads` does, could
  not tell one expert read twice from another never read.)
- **peak RSS** (VmHWM) against the RSS before the import (JAX, Orbax, TensorStore and
  hybridckpt loaded), the stream's peak tile bytes in flight and largest tile
  (`store.stream.StreamStats`) and the checkpoint's size; run_all also imports a source
  `--moe-large-gib` large (per-expert layout) to show the peak does not grow with the checkpoint;
- **time**, the median of `repeat` fresh processes, against the write and read floors of the source
  files (`benchmarks/floors.py`);
- **the kernel's count**: one more import (untimed) after the source's page cache is dropped,
  its `/proc/self/io` `read_bytes` beside the recorder's bytes (`benchmarks/kernel_io.py`).

`measure(src, dst, mesh)` is the in-process measurement (tests/jobs/test_moe_bench.py runs it at
a tiny size); `run(layout, gib, base)` writes, measures and cleans up; `benchmarks/run_all.py
--only g` prints the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator

import numpy as np

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

import floors  # noqa: E402
import kernel_io  # noqa: E402
from moe_sources import LAYOUTS, RANGES, config, expert_ranges, layers_for, source_files, write  # noqa: E402,F401

MESH = "dp=4,fsdp=2"


# -- the measurement (in the importing process) ---------------------------------------------------


def peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM)."""
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(next(x for x in fh if x.startswith(field + ":")).split()[1]) * 1024


def read_ratio(reads: dict[str, array], ranges: dict[str, list[tuple[int, int]]]) -> dict:
    """Bytes of `reads` (path -> flat `[offset, length, offset, length, ...]`) inside the expert
    ranges, and the expert bytes covered by at least one read: `ratio` = read / expert bytes,
    `covered` = covered / expert bytes. Each expert byte read exactly once iff both are 1."""
    import numpy as np

    total = read = covered = 0
    by_path = {
        os.path.abspath(p): np.frombuffer(a, np.int64).reshape(-1, 2) for p, a in reads.items()
    }
    for path, rs in ranges.items():
        starts = np.array([a for a, _ in rs], np.int64)
        ends = np.array([b for _, b in rs], np.int64)
        total += int((ends - starts).sum())
        got = by_path.get(path, np.zeros((0, 2), np.int64))
        lo, hi = got[:, 0], got[:, 0] + got[:, 1]
        # each read against the expert ranges it can touch (ranges are sorted and disjoint)
        first = np.searchsorted(ends, lo, side="right")
        last = np.searchsorted(starts, hi, side="left")
        for i in np.nonzero(last > first)[0]:
            a, b = first[i], last[i]
            read += int(
                np.clip(
                    np.minimum(ends[a:b], hi[i]) - np.maximum(starts[a:b], lo[i]), 0, None
                ).sum()
            )
        # the union of the reads, against the expert ranges
        order = np.argsort(lo, kind="stable")
        merged: list[list[int]] = []
        for a, b in zip(lo[order].tolist(), hi[order].tolist(), strict=True):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            j, k = np.searchsorted(ends, a, side="right"), np.searchsorted(starts, b, side="left")
            covered += int(
                np.clip(np.minimum(ends[j:k], b) - np.maximum(starts[j:k], a), 0, None).sum()
            )
    return {
        "expert_bytes": total,
        "expert_bytes_read": read,
        "expert_bytes_covered": covered,
        "ratio": read / total if total else float("nan"),
        "covered": covered / total if total else float("nan"),
    }


@contextlib.contextmanager
def recording() -> Iterator[dict[str, array]]:
    """Inside: every byte range read through `ByteSource`'s doors, per path as flat (offset,
    length) pairs, 16 bytes a read (`array.extend` of a tuple and `array.frombytes` hold the GIL
    throughout, so the reader threads' records never interleave); a planned read (`byte_source.planned`: the plan's dry
    reads, which read nothing) is not recorded. The doors: `read_into` (`read` goes through it),
    `copy_to`, `read_span` and `read_runs` (their runs: the gaps between runs, under a page each
    or read into a scratch buffer, are counted apart as gap bytes), `read_scatter` (one run into
    the rows of a strided buffer). A door left out undercounts, which the kernel's count flags."""
    from hybridckpt.io.byte_source import ByteSource, planned

    reads: dict[str, array] = {}
    doors = ("read_into", "copy_to", "read_span", "read_runs", "read_scatter")
    inner = {d: getattr(ByteSource, d) for d in doors}

    def record(path: str, starts, nbytes) -> None:
        if planned():  # (the plan thread's dry reads: counted by the plan, read by no one)
            return
        pairs = np.empty((len(starts), 2), np.int64)
        pairs[:, 0], pairs[:, 1] = starts, nbytes
        reads.setdefault(path, array("q")).frombytes(pairs.tobytes())

    def one(path: str, offset: int, nbytes: int) -> None:  # (one range: no array made)
        if not planned():
            reads.setdefault(path, array("q")).extend((offset, nbytes))

    def read_into(self, offset, buffer):
        one(self.path, offset, len(buffer))
        return inner["read_into"](self, offset, buffer)

    def copy_to(self, offset, nbytes, out_fd, out_offset):
        one(self.path, offset, nbytes)
        return inner["copy_to"](self, offset, nbytes, out_fd, out_offset)

    def read_span(self, offset, nbytes, run_starts, run_bytes):
        record(self.path, np.asarray(run_starts, np.int64) + offset, run_bytes)
        return inner["read_span"](self, offset, nbytes, run_starts, run_bytes)

    def read_runs(self, offsets, run_bytes, buffer, stride=None):
        record(self.path, np.asarray(offsets, np.int64), run_bytes)
        return inner["read_runs"](self, offsets, run_bytes, buffer, stride)

    def read_scatter(self, offset, views):
        one(self.path, offset, sum(len(v) for v in views))
        return inner["read_scatter"](self, offset, views)

    wrapped = {"read_into": read_into, "copy_to": copy_to, "read_span": read_span, "read_runs": read_runs,
               "read_scatter": read_scatter}
    for d in doors:
        setattr(ByteSource, d, wrapped[d])
    try:
        yield reads
    finally:
        for d in doors:
            setattr(ByteSource, d, inner[d])


def measure(src: str, dst: str, mesh: str = MESH) -> dict:
    """Import `src` into `dst` on `mesh` in this process (JAX's devices already set up), recording
    every byte range read; the figures of the module doc."""
    from hybridckpt import jobs
    from hybridckpt.store import stream

    ranges = expert_ranges(src)
    path, config_file = src, None
    if os.path.exists(os.path.join(src, RANGES)):  # titan: the checkpoint folder, HF config beside
        path, config_file = os.path.join(src, "checkpoint"), os.path.join(src, "config.json")
    opts = stream.StreamOptions()
    rss_before = _status("VmRSS")
    io0 = kernel_io.proc_io()
    with recording() as reads:
        t0 = time.perf_counter()
        s = jobs.import_checkpoint(
            path,
            dst,
            mesh=mesh,
            params_only=True,
            stream_options=opts,
            overwrite=True,
            config=config_file,
        )
        dt = time.perf_counter() - t0
    kernel = kernel_io.delta(io0, kernel_io.proc_io())
    files = source_files(src)
    return {
        "seconds": dt,
        "peak_rss": peak_rss(),
        "rss_before": rss_before,
        "array_bytes": s.bytes,
        "files_bytes": sum(os.path.getsize(f) for f in files),
        "bytes_read": sum(sum(a[1::2]) for a in reads.values()),
        "reads": sum(len(a) // 2 for a in reads.values()),
        "peak_inflight_bytes": opts.stats.peak_inflight_bytes,
        "largest_tile_bytes": opts.stats.largest_tile_bytes,
        "tiles": opts.stats.tiles,
        "kernel_io": kernel,
        **read_ratio(reads, ranges),
    }


def _child(src: str, dst: str, mesh: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # noqa: F401  (loaded before the RSS baseline, as are Orbax and TensorStore)
    import orbax.checkpoint  # noqa: F401
    import tensorstore  # noqa: F401

    import hybridckpt.jobs  # noqa: F401
    import hybridckpt.store.stream  # noqa: F401

    print(json.dumps(measure(src, dst, mesh)))


def run(
    layout: str, gib: float, base: str, *, experts: int = 32, mesh: str = MESH, repeat: int = 3
) -> dict:
    """Write the `layout` source of about `gib` GiB under `base`, import it `repeat` times (each
    in a fresh process; the run of median time, highest RSS, every read ratio kept) and measure the
    floors."""
    src, dst = os.path.join(base, f"moe_{layout}"), os.path.join(base, f"moe_{layout}_orbax")
    shutil.rmtree(src, ignore_errors=True)
    cfg = config(layers_for(gib, experts), experts)
    subprocess.run([sys.executable, HERE, "--_write", src, json.dumps(cfg), layout], check=True)
    try:
        files = source_files(src)
        fl = floors.measure(files, os.path.join(base, "floor"))
        runs = []
        for _ in range(repeat):
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            out = subprocess.run(
                [sys.executable, HERE, "--_child", src, dst, mesh],
                check=True,
                capture_output=True,
                text=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        # one more import on a cold cache (untimed): the kernel's count of the bytes read beside
        # the recorder's (`kernel_io`)
        shutil.rmtree(dst, ignore_errors=True)
        note = kernel_io.drop_cache(files)
        out = subprocess.run([sys.executable, HERE, "--_child", src, dst, mesh], check=True, capture_output=True,
                             text=True)
        cold = json.loads(out.stdout.strip().splitlines()[-1])
        check = kernel_io.cross_check(cold["bytes_read"], cold["kernel_io"], note)
        best = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])  # the median run
        best |= {
            "peak_rss": max(r["peak_rss"] for r in runs),
            "ratios": [r["ratio"] for r in runs],
            "coverages": [r["covered"] for r in runs],
            "runs": [round(r["seconds"], 2) for r in runs],
            "layout": layout,
            "layers": cfg["num_hidden_layers"],
            "experts": experts,
            "mesh": mesh,
            "floors": fl,
            "check": check,
            "expected_ratio": 1.0 + chunk_ends(layout, src),
        }
        return best
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)


def chunk_ends(layout: str, root: str) -> float:
    """The expert bytes a DCP import reads besides reading each element once, as a ratio of the
    expert bytes: each chunk's two ends are read to match or parse its `torch.save` archive
    (`formats.dcp.chunk`: the first and last `rest = length - element bytes` bytes), and of those
    `min(rest, element bytes)` are elements; 0 for the safetensors layouts. From torch's own
    metadata of the source (torch is a benchmark's dependency, never the library's)."""
    if layout != "titan":
        return 0.0
    import torch.distributed.checkpoint as dcp
    from moe_sources import TITAN_STEP, is_expert

    meta = dcp.FileSystemReader(os.path.join(root, "checkpoint", TITAN_STEP)).read_metadata()
    extra = total = 0
    for idx, info in meta.storage_data.items():
        if is_expert(idx.fqn):
            md = meta.state_dict_metadata[idx.fqn]
            n = int(np.prod(md.size)) * md.properties.dtype.itemsize
            extra, total = extra + min(info.length - n, n), total + n
    return extra / total if total else 0.0


def summary(r: dict) -> str:
    gib = 2**30
    return (
        f"{r['layout']}: {r['layers']} layers x {r['experts']} experts, {r['files_bytes'] / gib:.2f} GiB -> "
        f"{r['mesh']}: {r['seconds']:.1f} s (runs {r['runs']}; write floor {r['floors']['write_s']:.2f} s, "
        f"read floor {r['floors']['read_s']:.2f} s); expert bytes read {r['ratios']} x, covered "
        f"{r['coverages']}; peak RSS {r['peak_rss'] / gib:.2f} GiB ({r['rss_before'] / gib:.2f} before), "
        f"tiles in flight {r['peak_inflight_bytes'] / 2**20:.0f} MiB, largest tile "
        f"{r['largest_tile_bytes'] / 2**20:.0f} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=1.0, help="size of each source (fp32 GiB)")
    ap.add_argument("--experts", type=int, default=32, help="experts per layer")
    ap.add_argument("--mesh", default=MESH, help="the import's mesh (8 CPU devices)")
    ap.add_argument(
        "--layout", action="append", choices=LAYOUTS, help="source layouts (default: both)"
    )
    ap.add_argument(
        "--dir", default=None, help="where to write (default: a temporary folder, deleted)"
    )
    ap.add_argument(
        "--_write", nargs=3, metavar=("ROOT", "CONFIG", "LAYOUT"), help=argparse.SUPPRESS
    )
    ap.add_argument("--_child", nargs=3, metavar=("SRC", "DST", "MESH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._write:
        write(a._write[0], json.loads(a._write[1]), a._write[2])
        return
    if a._child:
        _child(*a._child)
        return
    base = a.dir or tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    try:
        for layout in a.layout or LAYOUTS:
            print(summary(run(layout, a.gib, base, experts=a.experts, mesh=a.mesh)), flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
