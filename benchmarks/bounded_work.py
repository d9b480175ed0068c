"""Time and memory of the readers on the large, hostile inputs of issue 38 (the tests count
objects and bytes; this script prints seconds and peak bytes).

    python benchmarks/bounded_work.py [--chunks 1000000] [--tensors 262144]

Rows (each built here, in a temporary folder):
- a billion-laughs `scheduler.pt` (torch.save of 10^13 shared floats): the pickle budget refuses it;
- a DCP `.metadata` of `--chunks` chunks pickled by torch's own classes, read by the general
  machine (the fast reader's fallback) with the expansion budget, and by `read_metadata`;
- a safetensors header of `--tensors` one-element tensors (the per-file cap, 2^18, by default)
  and one of cap + 1 (refused before its JSON is parsed).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import struct
import sys
import tempfile
import time


def _timed(fn):
    """(result, refusal, seconds, peak RSS of the process so far in bytes); no tracemalloc
    (it slows allocation-heavy readers several times)."""
    t = time.perf_counter()
    try:
        out = fn()
        err = None
    except Exception as e:  # a refusal is a result here
        out, err = None, f"{type(e).__name__}: {str(e)[:90]}"
    dt = time.perf_counter() - t
    return out, err, dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _row(name: str, err, dt: float, peak: int) -> None:
    print(f"| {name} | {dt:.2f} s | {peak / 2**20:.0f} MiB | {err or 'read'} |", flush=True)


def _dcp_metadata(path: str, chunks: int, per: int = 1000) -> None:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, sd = {}, {}
    for t in range(chunks // per):
        fqn = f"model.layers.{t}.w"
        cs = [ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 4])) for i in range(per)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([per, 4]), cs)
        for i in range(per):
            sd[MetadataIndex(fqn, torch.Size([i, 0]))] = _StorageInfo(f"__{i % 8}_0.distcp", i * 100, 100)
    with open(path, "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sdm, storage_data=sd), f)


def _safetensors(path: str, n: int) -> None:
    hdr = {f"model.layers.{i}.w": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    head = json.dumps(hdr).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"\0" * (4 * n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--tensors", type=int, default=None, help="default: the cap, 2^18")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    from hybridckpt.containers.dcp_stubs import DCP_POLICY
    from hybridckpt.containers.pickle import machine, torch_save
    from hybridckpt.containers.safetensors_file import MAX_TENSORS, read_header

    print("| input | time | peak RSS so far | result |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        x = [0.1] * 10
        for _ in range(12):
            x = [x] * 10
        sched = os.path.join(tmp, "scheduler.pt")
        torch.save({"last_lr": x}, sched)
        _row("billion-laughs scheduler.pt (10^13 floats)", *_timed(lambda: torch_save.load(sched))[1:])

        md = os.path.join(tmp, ".metadata")
        _dcp_metadata(md, args.chunks)
        with open(md, "rb") as f:
            data = f.read()
        _row(f"DCP .metadata, {args.chunks} chunks, general machine + budget ({len(data) >> 20} MiB)",
             *_timed(lambda: machine.safe_loads(data, DCP_POLICY, what=md))[1:])

        n = args.tensors or MAX_TENSORS
        for count in (n, MAX_TENSORS + 1):
            st = os.path.join(tmp, f"model{count}.safetensors")
            _safetensors(st, count)
            _row(f"safetensors header, {count} tensors ({os.path.getsize(st) >> 20} MiB)",
                 *_timed(lambda st=st: read_header(st))[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
