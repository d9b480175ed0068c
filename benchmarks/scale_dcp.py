"""DCP sources of a thousand ranks in minutes: torch's own `.metadata` objects built directly.

`scale_sources.write` runs torch's `DefaultSavePlanner` for every rank (hours at 1024 ranks:
the per-rank DTensor arithmetic, the pickled gathers, the global plan's validation). This module
writes the same checkpoint without the planner: it builds torch 2.13's own `Metadata`,
`TensorStorageMetadata`, `ChunkStorageMetadata`, `MetadataIndex`, `_StorageInfo` and
`WriteResult` objects with the values and the object sharing the planner path gives, and hands
them to torch's own `FileSystemWriter.finish`, which pickles the `.metadata`. `write_planner`
is the planner path (torch's planner for every rank, the gathers pickled per rank) with the same
data writer, and `check` shows both `.metadata` files equal byte for byte (run at 16 and 64 ranks:
`python benchmarks/scale_dcp.py DIR --check --ranks 16`; tests/jobs/test_scale_dcp.py at 4).

What the planner does that the direct build reproduces (torch 2.13 `default_planner`,
`_dedup_save_plans`, `filesystem`):
- every rank plans every key of the flattened state dict (`flatten_state_dict`): a SHARD item per
  DTensor (torch's `_compute_local_shape_and_global_offset` at the rank's mesh coordinate), a
  TENSOR item per plain tensor (the AdamW `step`), a BYTE_IO item per other value;
- `dedup_save_plans`: an item whose `MetadataIndex` (fqn, offset) several plans hold (the plain
  tensors, the byte items, the empty shards of a dim shorter than the ranks' chunks) stays with
  the plan of least planned storage (`tensor_storage_size()`: the whole tensor's bytes, or 1) at
  the time the item is met, items met in the order of first appearance;
- `create_default_global_save_plan`: a key's entry takes the properties and size of the first
  plan holding it, its chunks in plan order; a result's `MetadataIndex.index` is the chunk's
  place; the merged `planner_data` (`dict(ChainMap(*plans))`) has the last rank's keys and rank
  0's paths;
- the gathers pickle each rank's plan and results apart: objects are shared within a rank
  (a rank's fqn string is its mapping key; its results share one file name) and never across
  ranks; pickling keeps exactly that sharing, so the direct build makes a fresh string where
  the planner path has another rank's copy.

The `.distcp` files are what `FileSystemWriter._write_item` writes: per rank `__{rank}_0.distcp`,
byte items first (the `torch.save` of the value, as `DefaultSavePlanner.resolve_data` gives it),
then the tensors, each a `torch.save` archive of the rank's shard (zeros: only the archive's
non-zero bytes are written, the rest are holes that read as the zeros torch would write; the
archive of a shape is made once by torch.save). `holes=True` leaves every tensor a hole (the
metadata benchmarks read no tensor byte; 8 KiB of disk a chunk saved at 1024 ranks' 3.5M chunks).

    python benchmarks/scale_dcp.py DIR --ranks 1024 [--holes] [--params-only]
    python benchmarks/scale_dcp.py DIR --ranks 16 --check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import scale_sources  # noqa: E402

_ARCHIVES: dict = {}


def fresh(s: str) -> str:
    """An equal string that is a new object (what another rank's unpickled copy is)."""
    return (s + "\0")[:-1]


class _Runs:
    """A write-only stream that keeps only the non-zero stretches of what is written to it (zero
    runs under `gap` bytes kept inside): `torch.save` into it costs no copy of the tensor."""

    def __init__(self, gap: int = 4096):
        self.gap, self.n, self.runs = gap, 0, []  # runs: [start, bytearray]

    def write(self, b) -> int:
        import numpy as np

        mv = memoryview(b).cast("B")
        for s in range(0, len(mv), 1 << 24):
            part = mv[s:s + (1 << 24)]
            nz = np.flatnonzero(np.frombuffer(part, np.uint8))
            if len(nz):
                cut = np.flatnonzero(np.diff(nz) > self.gap)
                for a, z in zip(np.concatenate(([nz[0]], nz[cut + 1])), np.concatenate((nz[cut], [nz[-1]])) + 1, strict=True):
                    at = self.n + s + int(a)
                    if self.runs and at - (self.runs[-1][0] + len(self.runs[-1][1])) <= self.gap:
                        last = self.runs[-1]
                        last[1] += bytes(at - last[0] - len(last[1])) + bytes(part[a:z])
                    else:
                        self.runs.append([at, bytearray(part[a:z])])
        self.n += len(mv)
        return len(mv)

    def flush(self) -> None:
        pass

    def result(self) -> tuple[int, tuple]:
        return self.n, tuple((a, bytes(b)) for a, b in self.runs)


def saved(value) -> tuple[int, tuple]:
    """(length, non-zero runs) of `torch.save(value)` into a fresh stream."""
    import torch

    sink = _Runs()
    torch.save(value, sink)
    return sink.result()


def zeros_archive(sizes: tuple[int, ...], dtype) -> tuple[int, tuple]:
    """(length, non-zero runs) of the `torch.save` archive of a zero tensor of `sizes`, `dtype`
    (what `_write_item` writes for a rank's shard; made once per shape by torch.save)."""
    import torch

    key = (tuple(sizes), dtype)
    if key not in _ARCHIVES:
        _ARCHIVES[key] = saved(torch.zeros(key[0], dtype=dtype))
    return _ARCHIVES[key]


def write_rank_file(path: str, pieces, *, holes: bool = False) -> list[tuple[int, int]]:
    """Write one rank's `.distcp` sparse: `pieces` in order, each (length, runs); returns each
    piece's (offset, length). `holes`: tensor pieces (those given as a shape) left unwritten."""
    out, at = [], 0
    with open(path, "wb") as f:
        for length, runs, is_tensor in pieces:
            if not (holes and is_tensor):
                for off, blob in runs:
                    f.seek(at + off)
                    f.write(blob)
            out.append((at, length))
            at += length
        f.truncate(at)
    return out


def flat_items(params, layouts, *, moments: bool, group: dict | None):
    """The flattened state dict every rank plans, by torch's own `flatten_state_dict` of rank
    0's: ([(fqn, kind, value)], mappings); kind "shard" (value a `ShardProxy`), "tensor", "bytes"."""
    return flat_items_of(scale_sources.rank_state_dict(params, layouts, 0, moments=moments, param_groups=group))


def flat_items_of(sd: dict):
    """`flat_items` of the state dict `sd` (rank 0's)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(sd)
    items = []
    for fqn, v in flat.items():
        kind = ("shard" if isinstance(v, scale_sources.ShardProxy)
                else "tensor" if isinstance(v, torch.Tensor) else "bytes")
        items.append((fqn, kind, v))
    return items, mappings


class _Geometry:
    """Every rank's shard of one (shape, layout): offsets and sizes (torch's own
    `_compute_local_shape_and_global_offset`), and the ranks sharing one offset (empty shards)."""

    def __init__(self, shape, layout, world: int):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        self.shards = []
        coordinate = getattr(layout, "coordinate", lambda r: scale_sources._coordinate(r, layout.mesh))
        for r in range(world):
            sizes, offsets = _compute_local_shape_and_global_offset(
                shape, layout.mesh, list(coordinate(r)),
                [Shard(d) for d in layout.shard_dims])
            self.shards.append((tuple(offsets), tuple(sizes)))
        holders: dict = {}
        for r, (off, _) in enumerate(self.shards):
            holders.setdefault(off, []).append(r)
        self.first = [holders[off][0] for off, _ in self.shards]
        self.groups = {}  # offsets -> the set of ranks holding them, where several do
        for off, ranks in holders.items():
            if len(ranks) > 1:
                s: set = set()
                for r in ranks:  # built as dedup_save_plans builds it: added in plan order
                    s.add(r)
                self.groups[off] = s


def _dedup(items, geos, world: int):
    """`dedup_save_plans` on the plans every rank makes: {(item, offsets) or item: the plan
    keeping it} for every item several plans hold (the rest stay with their only plan)."""
    size = [0] * world
    every: set = set()
    for r in range(world):
        every.add(r)
    chosen: dict = {}
    storage = []
    for _fqn, kind, v in items:
        if kind == "shard":
            n = 4
            for d in v.shape:
                n *= d
            storage.append(n or 1)
        elif kind == "tensor":
            storage.append((v.numel() * v.element_size()) or 1)
        else:
            storage.append(1)
    for p in range(world):
        for i, (_fqn, kind, _v) in enumerate(items):
            if kind != "shard":
                if kind == "rank_bytes":  # a key of this rank only (torchtitan's `dataloader.dp_rank_{r}`)
                    size[p] += 1
                elif p == 0:
                    sel = min(every, key=size.__getitem__)
                    size[sel] += storage[i]
                    chosen[i] = sel
                continue
            g = geos[i]
            if g.first[p] != p:
                continue
            off = g.shards[p][0]
            group = g.groups.get(off)
            if group is None:
                size[p] += storage[i]
            else:
                sel = min(group, key=size.__getitem__)
                size[sel] += storage[i]
                chosen[(i, off)] = sel
    return chosen


def write_fast(root: str, params, layouts, world: int, *, moments: bool = True, config: dict | None = None,
               holes: bool = False, save_id: str | None = None, log=print) -> dict:
    """The DCP checkpoint of `world` ranks at `root`, `.metadata` as the planner path writes it."""
    group = scale_sources.adamw_group() if moments else None
    items, mappings = flat_items(params, layouts, moments=moments, group=group)
    return write_items(root, items, mappings, world, config=config, holes=holes, save_id=save_id, log=log)


def write_items(root: str, items, mappings, world: int, *, rank_mappings=None, config: dict | None = None,
                holes: bool = False, save_id: str | None = None, log=print) -> dict:
    """`write_fast` on rank 0's flattened `items` (`flat_items`) and `mappings`. Kind "rank_bytes":
    a byte item of fqn `...{rank}`, each rank's own; `rank_mappings(r)`: rank r's mappings then."""
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    cache, geos = {}, {}
    for i, (_fqn, kind, v) in enumerate(items):
        if kind == "shard":
            key = (tuple(v.shape), v.layout)
            if key not in cache:
                cache[key] = _Geometry(v.shape, v.layout, world)
            geos[i] = cache[key]
    chosen = _dedup(items, geos, world)
    log(f"  geometry and dedup of {world} ranks: {time.perf_counter() - t0:.0f} s")
    # the mappings as rank 0 and the last rank unpickle them (rank 0's paths, the last rank's keys)
    first_map = pickle.loads(pickle.dumps(mappings if rank_mappings is None else rank_mappings(0)))
    last_map = first_map if world == 1 else pickle.loads(pickle.dumps(
        mappings if rank_mappings is None else rank_mappings(world - 1)))
    first_keys, last_keys = list(first_map), list(last_map)
    # dict(ChainMap(*maps)): the last map's keys, then the other ranks' own keys (last to first);
    # values from the first map holding the key; a rank's own keys and paths are its objects
    merged = {k: first_map.get(k, last_map[k]) for k in last_map}
    own = [i for i, x in enumerate(items) if x[1] == "rank_bytes"]
    rank_keys = {0: [first_keys[i] for i in own], world - 1: [last_keys[i] for i in own]}
    for p in range(world - 2, -1, -1) if own else ():  # ChainMap adds them last to first
        m = first_map if p == 0 else rank_mappings(p)
        m = pickle.loads(pickle.dumps({k: m[k] for k in [items[i][0].format(rank=p) for i in own]})) if p else m
        rank_keys.setdefault(p, list(m))
        merged.update({k: m[k] for k in rank_keys[p]})
    byte_values = {i: saved(v) for i, (fqn, kind, v) in enumerate(items) if kind != "shard"}

    md: dict = {}
    results = []
    data_bytes = 0
    for p in range(world):
        mine = []  # (item, offsets, sizes) kept by plan p, in plan order
        for i, (_fqn, kind, _v) in enumerate(items):
            if kind != "shard":
                if kind == "rank_bytes" or chosen[i] == p:
                    mine.append((i, None, None))
                continue
            off, sz = geos[i].shards[p]
            if off in geos[i].groups and chosen[(i, off)] != p:
                continue
            mine.append((i, off, sz))
        index = {}
        for i, off, sz in mine:
            fqn, kind, v = items[i]
            key = last_keys[i] if p == world - 1 else first_keys[i] if p == 0 else fresh(fqn)
            key = rank_keys[p][own.index(i)] if kind == "rank_bytes" else key
            if kind in ("bytes", "rank_bytes"):
                md[key] = BytesStorageMetadata()
                continue
            entry = md.get(fqn)
            if entry is None:
                if kind == "shard":
                    props, size = TensorProperties(dtype=v.dtype), torch.Size(v.shape)
                else:
                    props, size = TensorProperties.create_from_tensor(v), v.size()
                entry = md[key] = TensorStorageMetadata(properties=props, size=size, chunks=[])
            index[i] = len(entry.chunks)
            if kind == "shard":
                entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
            else:
                entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size([0] * v.dim()), sizes=v.size()))
        order = sorted(mine, key=lambda x: items[x[0]][1] not in ("bytes", "rank_bytes"))  # stable
        pieces = []
        for i, _off, sz in order:
            kind, v = items[i][1], items[i][2]
            if kind == "shard":
                pieces.append((*zeros_archive(sz, v.dtype), True))
            else:
                pieces.append((*byte_values[i], False))
        file_name = f"__{p}_0.distcp"
        spans = write_rank_file(os.path.join(root, file_name), pieces, holes=holes)
        out = []
        for (i, off, _sz), (at, length) in zip(order, spans, strict=True):
            fqn, kind, v = items[i]
            if kind in ("bytes", "rank_bytes"):
                idx = MetadataIndex(fresh(fqn.format(rank=p) if kind == "rank_bytes" else fqn))
            elif kind == "tensor":
                idx = MetadataIndex(fresh(fqn), torch.Size([0] * v.dim()), index[i])
            else:
                idx = MetadataIndex(fresh(fqn), torch.Size(off), index[i])
            out.append(WriteResult(index=idx, size_in_bytes=length, storage_data=_StorageInfo(file_name, at, length)))
        results.append(out)
        data_bytes += spans[-1][0] + spans[-1][1] if spans else 0
        if p % 128 == 127:
            log(f"  rank {p + 1}/{world}: {time.perf_counter() - t0:.0f} s")
    metadata = Metadata(state_dict_metadata=md, planner_data=merged)
    writer = FileSystemWriter(root, single_file_per_rank=True, sync_files=False)
    writer.set_up_storage_writer(True)
    if save_id is not None:
        writer.save_id = save_id
    writer.finish(metadata=metadata, results=results)
    return _info(root, world, md, data_bytes, t0, config)


def _info(root, world, md, data_bytes, t0, config) -> dict:
    if config is not None:
        with open(os.path.join(root, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    info = {
        "ranks": world,
        "tensors": sum(1 for e in md.values() if hasattr(e, "chunks")),
        "chunks": sum(len(e.chunks) for e in md.values() if hasattr(e, "chunks")),
        "metadata_bytes": os.path.getsize(os.path.join(root, ".metadata")),
        "data_bytes": data_bytes,
        "seconds": time.perf_counter() - t0,
        "writer": "scale_dcp",
    }
    with open(os.path.join(root, "scale_source.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def write_planner(root: str, params, layouts, world: int, *, moments: bool = True, config: dict | None = None,
                  holes: bool = False, save_id: str | None = None, log=print) -> dict:
    """The same checkpoint by torch's own planner for every rank (`scale_sources.write`'s path:
    each rank's `DefaultSavePlanner.create_local_plan`, the gathers and scatters pickled per rank,
    the coordinator's `create_global_plan`, `FileSystemWriter.prepare_global_plan` and `finish`),
    with this module's data writer. Hours at 1024 ranks: the reference for `check`."""
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    group = scale_sources.adamw_group() if moments else None
    local_plans = []
    for r in range(world):
        planner = DefaultSavePlanner()
        planner.set_up_planner(scale_sources.rank_state_dict(params, layouts, r, moments=moments, param_groups=group),
                               None, r == 0)
        local_plans.append(pickle.loads(pickle.dumps(planner.create_local_plan())))  # gather_object
    coordinator = DefaultSavePlanner()
    coordinator.set_up_planner(scale_sources.rank_state_dict(params, layouts, 0, moments=moments, param_groups=group),
                               None, True)
    writer = FileSystemWriter(root, single_file_per_rank=True, sync_files=False)
    writer.set_up_storage_writer(True)
    if save_id is not None:
        writer.save_id = save_id
    global_plans, metadata = coordinator.create_global_plan(local_plans)
    global_plans = writer.prepare_global_plan(global_plans)
    del local_plans
    log(f"  plans of {world} ranks: {time.perf_counter() - t0:.0f} s")
    results, data_bytes = [], 0
    for r, plan in enumerate(global_plans):
        plan = pickle.loads(pickle.dumps(plan))  # scatter_object
        file_name = f"{plan.storage_data.prefix}0.distcp"
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        pieces = []
        for item in items:
            value = coordinator.state_dict[item.index.fqn]
            if item.type == WriteItemType.SHARD:
                pieces.append((*zeros_archive(tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype),
                               True))
            else:  # byte items, the plain step tensors: torch.save of the value
                assert item.type == WriteItemType.BYTE_IO or isinstance(value, torch.Tensor)
                pieces.append((*saved(value), False))
        spans = write_rank_file(os.path.join(root, file_name), pieces, holes=holes)
        out = [WriteResult(index=item.index, size_in_bytes=n, storage_data=_StorageInfo(file_name, at, n))
               for item, (at, n) in zip(items, spans, strict=True)]
        results.append(pickle.loads(pickle.dumps(out)))  # gather_object
        data_bytes += spans[-1][0] + spans[-1][1] if spans else 0
        global_plans[r] = None
    writer.finish(metadata=metadata, results=results)
    return _info(root, world, metadata.state_dict_metadata, data_bytes, t0, config)


def check(root: str, world: int, *, params=None, log=print) -> dict:
    """Write the `world`-rank source by the planner path and by `write_fast` at the same path with
    the same save id; their `.metadata` (and `.distcp` files) must be equal byte for byte."""
    import shutil
    import uuid

    params = params or scale_sources.llama_params(scale_sources.LLAMA_405B)
    layouts = scale_sources.fsdp(world)
    save_id = str(uuid.uuid4())
    got = {}
    for name, fn in (("planner", write_planner), ("fast", write_fast)):
        shutil.rmtree(root, ignore_errors=True)
        info = fn(root, params, layouts, world, save_id=save_id, log=log)
        files = {}
        for f in sorted(os.listdir(root)):
            if f.endswith(".distcp") or f == ".metadata":
                with open(os.path.join(root, f), "rb") as fh:
                    files[f] = _digest(fh)
        got[name] = (info, files)
        log(f"  {name}: {info['seconds']:.1f} s, .metadata {info['metadata_bytes']} bytes")
    same = got["planner"][1] == got["fast"][1]
    if not same:
        bad = [f for f in got["planner"][1] if got["planner"][1][f] != got["fast"][1].get(f)]
        raise AssertionError(f"{world} ranks: the fast path differs from the planner path in {bad[:5]}")
    return {"ranks": world, "files": len(got["fast"][1]), "metadata_bytes": got["fast"][0]["metadata_bytes"],
            "planner_s": got["planner"][0]["seconds"], "fast_s": got["fast"][0]["seconds"], "identical": same}


def _digest(fh) -> str:
    """SHA-256 of a file's size and its non-zero stretches with their offsets: equal for files
    of equal content, whichever of their zeros are holes (only the data segments are read)."""
    import hashlib

    h = hashlib.sha256()
    size = os.fstat(fh.fileno()).st_size
    h.update(size.to_bytes(8, "little"))
    at = 0
    while at < size:
        try:
            at = os.lseek(fh.fileno(), at, os.SEEK_DATA)
        except OSError:  # no data past `at`
            break
        end = os.lseek(fh.fileno(), at, os.SEEK_HOLE)
        fh.seek(at)
        sink = _Runs(gap=0)
        sink.n = at
        while at < end:
            chunk = fh.read(min(end - at, 1 << 24))
            sink.write(chunk)
            at += len(chunk)
        for off, blob in sink.result()[1]:
            h.update(off.to_bytes(8, "little") + len(blob).to_bytes(8, "little") + blob)
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--params-only", action="store_true", help="no optimizer state")
    ap.add_argument("--holes", action="store_true", help="leave every tensor a hole (metadata benchmarks)")
    ap.add_argument("--check", action="store_true", help="write by the planner and fast paths, compare bytes")
    a = ap.parse_args(argv)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    if a.check:
        print(json.dumps(check(a.dir, a.ranks, log=log)))
        return 0
    info = write_fast(a.dir, scale_sources.llama_params(scale_sources.LLAMA_405B), scale_sources.fsdp(a.ranks), a.ranks,
                      moments=not a.params_only, config=scale_sources.LLAMA_405B, holes=a.holes, log=log)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
