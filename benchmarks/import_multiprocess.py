"""Benchmark (d): the same import by 1 process (8 CPU devices) and by 2 processes (4 each)
under `jax.distributed` (gloo, coordinator on 127.0.0.1), as on 2 hosts.

    python benchmarks/import_multiprocess.py SRC [--mesh tp=4,pp=2]

Each process counts the checkpoint bytes it reads (`hybridckpt.io.byte_source.count_reads`),
and the kernel counts them too (`benchmarks/kernel_io.py`: the source's page cache is dropped
before each launch, so `/proc/self/io` `read_bytes` is what each process fetched from the disk);
reported: wall seconds of the slowest process (from the call to import_checkpoint, cold cache),
bytes read per process as a fraction of the checkpoint's tensor bytes by both counts, peak RSS
per process.
`run(src, base)` returns the figures; `benchmarks/run_all.py` prints them in its table.
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


def worker(pid: int, nproc: int, port: int, src: str, dst: str, mesh: str, out: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    sys.path.insert(0, os.path.dirname(HERE))
    from import_megatron import peak_rss
    from kernel_io import delta, proc_io

    from hybridckpt import jobs
    from hybridckpt.io.byte_source import count_reads

    io0 = proc_io()
    t0 = time.perf_counter()
    with count_reads() as counter:
        s = jobs.import_checkpoint(src, dst, mesh=mesh, params_only=True)
    dt = time.perf_counter() - t0
    kernel = delta(io0, proc_io())
    read = sum(v for k, v in counter.items() if isinstance(k, str))
    with open(out, "w") as f:
        json.dump({"seconds": dt, "bytes_read": read, "kernel_io": kernel, "tensor_bytes": s.bytes,
                   "peak_rss": peak_rss(), "devices": len(jax.local_devices())}, f)
    if nproc > 1:
        jax.distributed.shutdown()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, src: str, dst: str, mesh: str, base: str) -> list[dict]:
    port = _port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outs = [os.path.join(base, f"mp{nproc}_{p}.json") for p in range(nproc)]
    procs = [
        subprocess.Popen(
            [sys.executable, HERE, "--_worker", str(p), str(nproc), str(port), src, dst, mesh, outs[p]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for p in range(nproc)
    ]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("multi-process import failed:\n" + "\n".join(x[-3000:] for x in logs))
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    return res


def run(src: str, base: str, mesh: str = "tp=4,pp=2") -> dict:
    """{1: [process figures], 2: [...]}; each process's figures carry "check", the kernel's count
    beside the library's (`kernel_io.cross_check`)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from kernel_io import cross_check, drop_cache

    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs)
    out = {}
    for nproc in (1, 2):
        dst = os.path.join(base, f"mp_orbax_{nproc}")
        note = drop_cache(files)
        out[nproc] = launch(nproc, src, dst, mesh, base)
        for p in out[nproc]:
            p["check"] = cross_check(p["bytes_read"], p["kernel_io"], note)
        shutil.rmtree(dst, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="?")
    ap.add_argument("--mesh", default="tp=4,pp=2")
    ap.add_argument("--_worker", nargs=7, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        pid, nproc, port, src, dst, mesh, out = a._worker
        worker(int(pid), int(nproc), int(port), src, dst, mesh, out)
        return
    base = tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    try:
        print(json.dumps(run(a.src, base, a.mesh), indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
