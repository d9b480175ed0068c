"""The plan of one host of an import, estimated from a sample of its tiles, where the whole plan
(`hybridckpt inspect SRC --plan --processes N --process P`) takes too long to run here.

The import's own path, as `jobs.plan_report.plan_import` runs it: the source opened and the
lazy targets built on `--mesh` (devices simulated on the CPU), every tile of every leaf listed
and those of process `--process` of `--processes` kept (its share: their bytes over all the
arrays'); then a fixed random sample of them (seed 0) passed through the leaf's `read_into` with
the file reads dry (`io.byte_source.planning`) and counted (`count_reads`) for `--seconds`, and
the time and reads extrapolated to all its tiles by bytes. Prints one JSON line.

    XLA_FLAGS=--xla_force_host_platform_device_count=288 JAX_PLATFORMS=cpu \\
        python benchmarks/scale_plan_sample.py SRC --mesh tp=8,pp=9,fsdp=4 --processes 36 --seconds 120
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import sys
import time
from collections import Counter


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--processes", type=int, required=True)
    ap.add_argument("--process", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=120.0, help="time spent planning sampled tiles")
    ap.add_argument("--sample", type=int, default=400, help="at most this many tiles")
    a = ap.parse_args(argv)

    import jax

    from hybridckpt.io.byte_source import count_reads, planning
    from hybridckpt.io.direct_io import aligned_empty
    from hybridckpt.jobs.import_ import lazy_targets
    from hybridckpt.jobs.open import open_checkpoint
    from hybridckpt.jobs.plan_report import _tally, process_of
    from hybridckpt.plan import box_owners
    from hybridckpt.store import stream

    t0 = time.perf_counter()
    lt = lazy_targets(open_checkpoint(a.src), mesh=a.mesh)
    leaves = [x for x in jax.tree.leaves((lt.params, lt.opt_state), is_leaf=lambda x: isinstance(x, stream.LazyLeaf))
              if isinstance(x, stream.LazyLeaf)]
    t_open = time.perf_counter() - t0
    owner = process_of(a.processes)
    mine = []  # this process's tiles, cut as that host's save cuts them (its boxes joined, `stream.owned_tiles`)
    for leaf in leaves:
        chunk = stream.chunk_shape(leaf)
        boxes = [box for box, dev in box_owners(leaf.shape, leaf.sharding).items() if owner(dev) == a.process]
        for box in stream.joined_boxes(boxes):
            mine += [(leaf, t) for t in stream.box_tiles(leaf, box, chunk, lt.options.tile_bytes,
                                                         lt.options.inflight_bytes, owner)]
    t_list = time.perf_counter() - t0 - t_open
    total = sum(x.nbytes for x in leaves)
    wbytes = sum(math.prod(b - s for s, b in box) * leaf.dtype.itemsize for leaf, box in mine)
    sample = random.Random(0).sample(mine, min(len(mine), a.sample))
    counts: Counter = Counter()
    done = sbytes = 0
    t1 = time.perf_counter()
    for leaf, box in sample:
        shape = tuple(b - s for s, b in box)
        with count_reads(this_thread=True) as c, planning():
            leaf.tensor.read_into(box, aligned_empty(shape, leaf.dtype))
        counts.update(c)
        done += 1
        sbytes += math.prod(shape) * leaf.dtype.itemsize
        if time.perf_counter() - t1 > a.seconds:
            break
    dt = time.perf_counter() - t1
    nbytes, reads, _, paths = _tally(counts)
    scale = wbytes / max(sbytes, 1)
    print(json.dumps({
        "mesh": a.mesh, "processes": a.processes, "process": a.process, "open_s": round(t_open, 1),
        "list_tiles_s": round(t_list, 1), "arrays_bytes": total, "tiles": len(mine), "write_bytes": wbytes,
        "share": wbytes / total, "sampled_tiles": done, "sampled_bytes": sbytes, "sample_s": round(dt, 1),
        "sample_reads": reads, "sample_read_bytes": nbytes, "sample_files": len(paths),
        "est_plan_s": round(t_open + t_list + dt * scale), "est_reads": round(reads * scale),
        "est_read_bytes": round(nbytes * scale),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
