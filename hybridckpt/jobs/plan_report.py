"""The plan of an import, before running it: per process and per device of the target mesh, the
bytes it reads, its reads (preads after coalescing, as the reader does them), the files it
touches and the bytes it writes. Nothing is written and no tensor byte is read.

It cannot drift from the import because it is the import's own path: the leaves come from
`jobs.import_.lazy_targets` (the same sharding plan, names, casts, optimizer slots), the tiles
from `plan.box_owners` and `store.stream.plan_tiles` (the boxes the streaming save writes, each
by the process of its lowest-id holding device), and each tile is passed through the leaf's own
`read_into` with the file reads dry (`io.byte_source.planning`): the reader decides its preads,
spans and gaps exactly as in the import, and `count_reads` counts them, but the bytes are never
read. Metadata a lazy tensor parses on first use (a DCP chunk's `torch.save` header) is read
for real and counted, as the import counts it. The element copies are left out too
(`lazy.copy_into` under `planning`), so its cost is the reader's bookkeeping per tile, a few
reused tile buffers and those headers: no checkpoint-sized memory or time.

Bytes read are the bytes the reader asks for (a span's gaps, which lie in pages the runs touch
anyway, are counted apart as `gap_bytes`); bytes written are the tiles' bytes (raw chunks; a
compressed save writes less).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hybridckpt.io.read_tally import remote_requests, runs_of, tally
from hybridckpt.io.remote.view import shown


@dataclass(frozen=True)
class DevicePlan:
    """One device's share of an import: the boxes it owns (the lowest-id device holding them),
    which its process reads and writes."""

    device: int  # jax device id
    process: int  # its process index
    bytes_read: int  # bytes the reader asks for (gaps of spans apart)
    reads: int  # read calls (a span of close runs is one, a batch of runs `read_runs` joins too)
    gap_bytes: int  # bytes read between the runs of spans and batches
    files: tuple[str, ...]  # files read, sorted
    bytes_written: int  # bytes of the tiles it writes
    tiles: int
    runs: int = 0  # contiguous file runs those calls fetched (> reads where runs were joined)
    requests: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # a source in a bucket: host ->
    # {"requests", "bytes"} its ranged GETs (each read alone: no sharing between devices; an upper bound)


@dataclass(frozen=True)
class ProcessPlan:
    process: int
    bytes_read: int
    reads: int
    gap_bytes: int
    files: tuple[str, ...]
    bytes_written: int
    tiles: int
    runs: int = 0
    requests: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # its devices' (`DevicePlan`)


@dataclass(frozen=True)
class ImportPlan:
    """The plan of an import of `source` onto `mesh`: per device and per process."""

    source: str
    source_format: str
    mesh: str
    tensors: int  # arrays written (params, slots, step counter, zero-filled state)
    tensor_bytes: int  # their bytes, each counted once
    devices: tuple[DevicePlan, ...]
    processes: tuple[ProcessPlan, ...]
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return asdict(self)


_tally = tally  # (bytes, calls, gap bytes, paths) of a `count_reads` counter


def _summed(per: Any) -> dict[str, dict[str, int]]:
    """Host -> {"requests", "bytes"} summed over several such maps."""
    out: dict[str, dict[str, int]] = {}
    for m in per:
        for host, r in m.items():
            e = out.setdefault(host, {"requests": 0, "bytes": 0})
            e["requests"] += r["requests"]
            e["bytes"] += r["bytes"]
    return out


def process_of(processes: int | None):
    """The process index of a device: jax's (`processes` None), or the device's place among
    `jax.devices()` split in `processes` equal consecutive runs, as `jax.distributed` orders the
    devices of that many hosts (to plan one host of a run this process is not part of)."""
    if processes is None:
        return lambda dev: dev.process_index
    import jax

    devs = jax.devices()
    if processes < 1 or len(devs) % processes:
        from hybridckpt.errors import ConfigError

        raise ConfigError(f"--processes {processes}: expected a positive divisor of the {len(devs)} devices")
    place = {d.id: i for i, d in enumerate(devs)}
    per = len(devs) // processes
    return lambda dev: place[dev.id] // per


def inside(box: Any, outer: Any) -> bool:
    """Whether `box` lies inside `outer` (both tuples of (start, stop))."""
    return all(a <= x and y <= b for (a, b), (x, y) in zip(outer, box, strict=True))


def plan_leaves(leaves: list[Any], tile_bytes: int, process: int | None = None,
                processes: int | None = None, inflight_bytes: int | None = None) -> dict[int, dict]:
    """Per device id: {"process", "counter" (`count_reads` of its tiles), "written", "tiles",
    "leaves" (reads and bytes per leaf name)}, for the devices of `process` (None: every
    process); `processes`: see `process_of`. Each distinct box of a leaf is its lowest-id holding
    device's; a process's boxes joined as the save joins them (`store.stream.joined_boxes`: the
    strips of one row side by side, read once) are the lowest of those devices', cut into the save's tiles (`store.stream.box_tiles`, whose probe of the first tile
    reads the headers a reader parses on first use: counted to that device, as the import reads
    them then), in the save's order. With `processes`, the tile size is found on the first box
    as that host split joins it (`stream.leaf_tiling`'s `owner`), as each host of such a run
    finds it, not on every device's boxes joined as this one process holds them."""
    from hybridckpt.io.byte_source import count_reads, planning
    from hybridckpt.io.direct_io import aligned_empty
    from hybridckpt.plan import box_owners
    from hybridckpt.store.stream import INFLIGHT_BYTES, box_tiles, chunk_shape, joined_boxes

    out: dict[int, dict] = {}
    buffers: dict[tuple, np.ndarray] = {}  # one reused buffer per (shape, dtype): no memory growth
    owner = process_of(processes)
    split = None if processes is None else owner  # the tile size's first box: joined as that host would join it
    for leaf in leaves:
        chunk = chunk_shape(leaf)
        owners = box_owners(leaf.shape, leaf.sharding)
        per_process: dict[int, list] = {}
        for b, dev in owners.items():
            per_process.setdefault(owner(dev), []).append(b)
        wanted = sorted(per_process) if process is None else [process] if process in per_process else []
        for proc, box in [(p, j) for p in wanted for j in joined_boxes(per_process[p])]:
            dev = owners[min(b for b in per_process[proc] if inside(b, box))]  # the joined box's lowest device
            d = out.setdefault(dev.id, {"process": proc, "counter": Counter(), "written": 0, "tiles": 0,
                                        "leaves": Counter()})
            with count_reads(this_thread=True, planned_too=False) as probe:  # headers only
                tiles = box_tiles(leaf, box, chunk, tile_bytes, inflight_bytes or INFLIGHT_BYTES, split)
            counters = [probe]
            for tile in tiles:
                shape = tuple(b - a for a, b in tile)
                key = (shape, leaf.dtype)
                if key not in buffers:
                    buffers.clear()
                    buffers[key] = aligned_empty(shape, leaf.dtype)
                with count_reads(this_thread=True) as c, planning(), np.errstate(all="ignore"):  # unread values
                    leaf.tensor.read_into(tile, buffers[key])
                counters.append(c)
                d["written"] += math.prod(shape) * leaf.dtype.itemsize
                d["tiles"] += 1
            for c in counters:
                d["counter"].update(c)
                nbytes, calls, _, _ = _tally(c)
                d["leaves"][(leaf.name, "reads")] += calls
                d["leaves"][(leaf.name, "runs")] += runs_of(c)
                d["leaves"][(leaf.name, "bytes")] += nbytes
    return out


SHORT_READ_BYTES = 4096  # a process whose reads average less than a page reads a strip of every row


def short_read_notes(per: dict[int, dict], leaves: list[Any], top: int = 3) -> tuple[str, ...]:
    """A line per process whose reads average under `SHORT_READ_BYTES`, naming the `top` arrays
    with the most reads and their sharding: such reads cost a round trip each (a seek, a network
    request) more than their bytes. They come from a target mesh cutting an array along a
    dimension its source stored contiguously (FSDP2 and Megatron cut the first dimension of
    torch's `[out, in]`; an axis on the other reads a short strip of every source row)."""
    specs = {x.name: getattr(x.sharding, "spec", None) for x in leaves}
    by_process: dict[int, Counter] = {}
    for d in per.values():
        by_process.setdefault(d["process"], Counter()).update(d["leaves"])
    notes = []
    for proc in sorted(by_process):
        c = by_process[proc]
        names = {k[0] for k in c}
        reads, nbytes = sum(c[(n, "reads")] for n in names), sum(c[(n, "bytes")] for n in names)
        if not reads or nbytes / reads >= SHORT_READ_BYTES:
            continue
        worst = sorted(names, key=lambda n: -c[(n, "reads")])[:top]
        which = "; ".join(f"{n} {specs.get(n)}: {c[(n, 'reads')]} reads of {c[(n, 'bytes')] / max(1, c[(n, 'reads')]):.0f} B"
                          for n in worst)
        notes.append(f"process {proc}: {reads} reads of {nbytes / reads:.0f} B on average (under a page: the mesh "
                     f"cuts arrays along a dimension the source stored contiguously, a strip of every row; a mesh "
                     f"axis on the dimension the source's ranks cut reads whole rows). Most reads: {which}")
    return tuple(notes)


def plan_import(
    src: str | os.PathLike,
    *,
    fmt: str = "auto",
    mesh: Any = "dp=1",
    config: Any = None,
    rules: str | os.PathLike | None = None,
    params_only: bool = False,
    dtype: str | None = None,
    strict_sharding: bool = False,
    step: int | None = None,
    process: int | None = None,
    processes: int | None = None,
    stream_options: Any = None,
    param_order: Any = None,
) -> ImportPlan:
    """The plan of `import_checkpoint(src, ..., mesh=mesh)` with the same arguments; `process`:
    only that process's devices (None: all); `processes`: the devices split over that many
    processes (`process_of`; None: jax's own). Opens the source (metadata) and reads nothing else."""
    import jax

    from hybridckpt.jobs.import_ import lazy_targets
    from hybridckpt.jobs.open import open_checkpoint
    from hybridckpt.mesh import MeshShape
    from hybridckpt.store import stream

    t0 = time.perf_counter()
    opened = open_checkpoint(src, fmt, config=config, rules=rules, step=step, param_order=param_order)
    lt = lazy_targets(opened, mesh=mesh, params_only=params_only, dtype=dtype, strict_sharding=strict_sharding,
                      stream_options=stream_options)
    written = [x for x in jax.tree.leaves((lt.params, lt.opt_state), is_leaf=lambda x: isinstance(x, stream.LazyLeaf))
               if isinstance(x, stream.LazyLeaf)]
    per = plan_leaves(written, lt.options.tile_bytes, process, processes, lt.options.inflight_bytes)
    if process is not None and not per:
        from hybridckpt.errors import ConfigError

        raise ConfigError(f"--process {process}: no device of mesh {MeshShape.of(lt.mesh)} belongs to that process")
    devices = []
    for dev_id in sorted(per):
        d = per[dev_id]
        nbytes, calls, gaps, paths = _tally(d["counter"])
        files = tuple(sorted(str(shown(f)) for f in paths))  # a bucket's files by their URLs
        devices.append(DevicePlan(dev_id, d["process"], nbytes, calls, gaps, files, d["written"], d["tiles"],
                                  runs_of(d["counter"]), remote_requests(d["counter"])))
    processes = []
    for p in sorted({d.process for d in devices}):
        mine = [d for d in devices if d.process == p]
        processes.append(ProcessPlan(
            p, sum(d.bytes_read for d in mine), sum(d.reads for d in mine), sum(d.gap_bytes for d in mine),
            tuple(sorted({f for d in mine for f in d.files})), sum(d.bytes_written for d in mine),
            sum(d.tiles for d in mine), sum(d.runs for d in mine), _summed(d.requests for d in mine),
        ))
    return ImportPlan(
        opened.path, opened.format, str(MeshShape.of(lt.mesh)), len(written), sum(x.nbytes for x in written),
        tuple(devices), tuple(processes), time.perf_counter() - t0,
        lt.plan.notes + short_read_notes(per, written),  # the sharding's notes first (a dim replicated)
    )
