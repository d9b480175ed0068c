"""Megatron-Core `torch_dist` sources of hundreds of ranks: the `.metadata` megatron-core 0.19.2
writes, built from torch's own objects and pickled by torch's own `FileSystemWriter.finish`.

megatron-core cannot run hundreds of ranks here, so this module replays, for a GPT model of any
size and any TP x PP x DP, what megatron-core 0.19.2 (torch 2.13) puts in a `torch_dist` save of
the model and the distributed optimizer in its default `dp_reshardable` format, following its
source (NVIDIA/Megatron-LM core_v0.19.0, the files named below) and the real saves of the corpus
(`tests/real/cases/megatron_core_dense_dp_reshardable`, TP 2 x PP 2 x DP 2, written by megatron
itself):

- ranks: `rank = tp + TP * (dp + DP * pp)` (parallel_state.py, order `tp-cp-ep-dp-pp`);
- the model (local spec, `--transformer-impl local`, as the real case): one key per parameter,
  the layers stacked (`decoder.layers.<name>`, global shape `[L, ...]`), one chunk per layer x
  TP shard (`linear_qkv` / `linear_fc1` / embedding / output rows, `linear_proj` / `linear_fc2`
  columns; `linear_fc1` as two chunks a TP rank, its gate and up rows), the norms replicated
  (saved by the TP-0 domain); a `ShardedObject` `<module>._extra_state/shard_<layer>_<L>` per
  layer and linear module; every DP replica saved once, by the DP rank megatron's
  `distribute_shards_to_ranks` picks (dist_checkpointing/exchange_utils.py: lowest coverage
  first, then largest bytes, then shard id; to the least loaded rank);
- the optimizer (`dp_reshardable`, optimizer/distrib_optimizer.py
  `sharded_param_state_dp_reshardable`, `_compute_per_buffer_param_layout`; param_layout.py):
  per model-parallel domain `g = tp + TP * pp` one grad buffer of the stage's params in REVERSE
  order, each start padded to 64 elements, cut into buckets of `bucket_size` elements
  (`max(40M, 1M * DP)` with `--overlap-grad-reduce`, else one bucket), each bucket end padded
  to `lcm(DP, 128)`; the keys `optimizer.distributed.dp_group_idx_<g>.gbuf_idx_0.dtype_(<param>,
  <grad>).bucket_idx_<k>.{param,exp_avg,exp_avg_sq}` of the bucket's unpadded size, each DP
  rank's slice cut at every parameter and padding edge; the ShardedObjects
  `optimizer.distributed.dp_group_idx_<g>.{optimizer,per_bucket_numel,per_bucket_numel_unpadded}`;
- per rank `rerun_state_machine_state/shard_<r>_<world>`, per (pp, tp) `rng_state/shard_<pp>.<tp>_
  <PP>.<TP>`, and `common_state/shard_0_1` (rank 0);
- the DCP layer (dist_checkpointing/strategies/torch.py `MCoreSavePlanner.create_local_plan`,
  checkpointable.py): per rank a `SavePlan` of its items in state-dict order, a key's local
  chunks together (a `LocalShardsContainer`, `MetadataIndex.index` = the chunk's place among
  them when a rank saves more than one chunk of the key, else None); every plan gathered into
  `Metadata.all_local_plans` (state_dict_saver.py), `planner_data` None, the global metadata in
  plan order (torch's `create_default_global_save_plan`: a tensor's properties and size the
  first plan's objects, its chunks the plans' own chunk objects), the storage entries with the
  local plans' indices; per rank one `__<r>_0.distcp`, its byte items first, then its tensors.
- the byte items' contents are the real case's (`[None]` extra states, the rng and rerun
  states, the optimizer's param groups), `per_bucket_numel*` this layout's numbers, and the
  `common_state` is the real case's with only the sizes it states changed (`args`: layers,
  widths, heads, vocabulary, TP / PP / DP / world size, dtype flags): megatron's enums in it are
  kept as stand-ins that pickle back under their own names (megatron does not import here).

Checked against the real files: `python benchmarks/scale_torch_dist.py DIR --like-real` writes the
real case's model (2 layers, hidden 16, ...) at TP 2 x PP 2 x DP 2 and `compare` finds the same
`.metadata` as megatron's: the key set and order, every tensor's size, dtype and chunk boxes in
order, every storage entry (file, offset, length), every rank's plan items (index, type,
chunk, size); tests/jobs/test_scale_torch_dist.py runs it. What is not imitated: virtual pipeline
stages, uneven pipeline splits, the TE spec's parameter order, MoE, megatron's thread-split
files (`__<r>_<t>.distcp`, t > 0), and the tensors' bytes (sparse: holes, as scale_dcp).

    python benchmarks/scale_torch_dist.py DIR --tp 8 --pp 9 --dp 4 [--holes]
    python benchmarks/scale_torch_dist.py DIR --like-real --check REAL_ITER_DIR
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import scale_dcp  # noqa: E402
from megatron_common_state import common_state  # noqa: E402

TREE = os.path.dirname(HERE)
REAL = os.path.join(TREE, "tests", "real", "cases", "megatron_core_dense_dp_reshardable", "ckpt", "iter_0000003")

# Llama 3.1 405B (126 layers; NeMo 2's llama31_405b recipe runs TP 8 x PP 9)
LLAMA_405B = {"num_layers": 126, "hidden_size": 16384, "ffn_hidden_size": 53248, "num_attention_heads": 128,
              "num_query_groups": 8, "padded_vocab_size": 128256, "vocab_size": 128256, "seq_length": 8192,
              "bf16": True, "overlap_grad_reduce": True}
# the real case's model (tests/real/cases/megatron_core_dense_dp_reshardable/manifest.json)
LIKE_REAL = {"num_layers": 2, "hidden_size": 16, "ffn_hidden_size": 24, "num_attention_heads": 4,
             "num_query_groups": 2, "padded_vocab_size": 64, "vocab_size": 60, "seq_length": 8,
             "bf16": False, "overlap_grad_reduce": False}


def _params(m: dict, tp: int, pp_rank: int, pp: int):
    """The stage's parameters in `named_parameters()` order: [(key, global shape, layer or None,
    split)], split None (replicated over TP), ("rows", n) or ("cols", n): n row / column blocks
    of the TP-local shard (linear_fc1: its gate and up rows, 2 blocks)."""
    h, f, L = m["hidden_size"], m["ffn_hidden_size"], m["num_layers"]
    kv = h // m["num_attention_heads"]
    qkv = (m["num_attention_heads"] + 2 * m["num_query_groups"]) * kv
    per = L // pp
    out = []
    if pp_rank == 0:
        out.append(("embedding.word_embeddings.weight", (m["padded_vocab_size"], h), None, ("rows", 1)))
    for layer in range(pp_rank * per, (pp_rank + 1) * per):
        out += [
            ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (L, h), layer, None),
            ("decoder.layers.self_attention.linear_proj.weight", (L, h, m["num_attention_heads"] * kv), layer, ("cols", 1)),
            ("decoder.layers.self_attention.linear_qkv.weight", (L, qkv, h), layer, ("rows", 1)),
            ("decoder.layers.mlp.linear_fc1.layer_norm_weight", (L, h), layer, None),
            ("decoder.layers.mlp.linear_fc1.weight", (L, 2 * f, h), layer, ("rows", 2)),
            ("decoder.layers.mlp.linear_fc2.weight", (L, h, f), layer, ("cols", 1)),
        ]
    if pp_rank == pp - 1:
        out.append(("decoder.final_layernorm.weight", (h,), None, None))
        out.append(("output_layer.weight", (m["padded_vocab_size"], h), None, ("rows", 1)))
    return out


_EXTRA = {"decoder.layers.self_attention.linear_proj.weight": "decoder.layers.self_attention.linear_proj._extra_state",
          "decoder.layers.self_attention.linear_qkv.weight": "decoder.layers.self_attention.linear_qkv._extra_state",
          "decoder.layers.mlp.linear_fc1.weight": "decoder.layers.mlp.linear_fc1._extra_state",
          "decoder.layers.mlp.linear_fc2.weight": "decoder.layers.mlp.linear_fc2._extra_state"}


def _shards(key, shape, layer, split, tp_rank, tp):
    """This TP rank's chunks of a parameter: [(offsets, sizes)] (global, the layer axis first)."""
    lead = () if layer is None else (layer,)
    body = shape if layer is None else shape[1:]
    if split is None:
        return [(lead + (0,) * len(body), (1,) * len(lead) + tuple(body))]
    how, n = split
    dim = 0 if how == "rows" else 1
    part = body[dim] // (n * tp)
    out = []
    for b in range(n):
        off = [0] * len(body)
        off[dim] = b * (body[dim] // n) + tp_rank * part
        size = list(body)
        size[dim] = part
        out.append((lead + tuple(off), (1,) * len(lead) + tuple(size)))
    return out


def _numel(sizes) -> int:
    return math.prod(sizes)


def _buckets(params_local: list[int], dp: int, bucket_size):
    """`_compute_per_buffer_param_layout` (no shared embedding): params (local numels, forward
    order) laid out in reverse -> ([(start, end, bucket)] per reversed param, [(bucket_start,
    bucket_end)], [numel_unpadded])."""
    div = math.lcm(dp, 128)
    pad = lambda x, d: -(-x // d) * d  # noqa: E731
    where, buckets, unpadded = [], [], []
    start = bstart = 0
    n_in = 0
    end = 0
    for numel in params_local[::-1]:
        start = pad(start, 64)
        end = start + numel
        where.append((start, end, len(buckets)))
        n_in += 1
        if bucket_size is not None and end - bstart >= bucket_size:
            unpadded.append(end - bstart)
            bend = pad(end, div)
            buckets.append((bstart, bend))
            bstart = start = bend
            n_in = 0
        else:
            start = end
    if n_in:
        unpadded.append(end - bstart)
        buckets.append((bstart, pad(end, div)))
    return where, buckets, unpadded


def _bucket_chunks(where, bucket, b_start, b_end, unpadded, dp):
    """Each DP rank's chunks of one bucket (`sharded_param_state_dp_reshardable`): {dp rank:
    [(world offset, size)]}, params and the padding between them."""
    loc = (b_end - b_start) // dp
    spans = [(s - b_start, e - b_start) for s, e, k in where if k == bucket]
    out = {}
    for r in range(dp):
        lo, hi = r * loc, (r + 1) * loc
        mine = [(max(s, lo) - lo, min(e, hi) - lo) for s, e in spans if s < hi and e > lo]
        chunks = []
        for i in range(-1, len(mine)):
            nxt = loc if i == len(mine) - 1 else mine[i + 1][0]
            cur = 0 if i == -1 else mine[i][1]
            if nxt != cur and r * loc + cur < unpadded:
                chunks.append((r * loc + cur, nxt - cur))
            if i + 1 < len(mine):
                chunks.append((r * loc + mine[i + 1][0], mine[i + 1][1] - mine[i + 1][0]))
        out[r] = chunks
    return out


def _distribute(shard_to_ranks: dict, shard_to_size: dict, n: int) -> dict:
    """megatron's `distribute_shards_to_ranks` (no cross-group loads)."""
    sizes = [(0, r) for r in range(n)]
    chosen = {}
    for sid, ranks in sorted(shard_to_ranks.items(), key=lambda kv: (0, len(kv[1]), -shard_to_size[kv[0]], kv[0])):
        size, rank = min((s, r) for s, r in sizes if r in ranks)
        chosen[sid] = rank
        sizes[rank] = (size + shard_to_size[sid], rank)
    return chosen


def real_blobs(real: str = REAL) -> dict:
    """{key: bytes} of the real case's byte items (their `torch.save` archives)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(real).read_metadata()
    out = {}
    for idx, si in md.storage_data.items():
        if idx.offset is None:
            with open(os.path.join(real, si.relative_path), "rb") as f:
                f.seek(si.offset)
                out[idx.fqn] = f.read(si.length)
    return out


def per_bucket(dtypes, numels) -> bytes:
    import torch

    sink = io.BytesIO()
    torch.save([[{dtypes: list(numels)}]], sink)
    return sink.getvalue()


def write(root: str, m: dict, tp: int, pp: int, dp: int, *, holes: bool = False, blobs: dict | None = None,
          save_id: str | None = None, checkpoint_id: str | None = None, log=print) -> dict:
    """The torch_dist checkpoint `root/iter_0000001` of a TP x PP x DP run of model `m`
    (`save_id`, `checkpoint_id`: the `storage_meta` to state, for a byte comparison)."""
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
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    t0 = time.perf_counter()
    world = tp * pp * dp
    blobs = blobs or real_blobs()
    pdt = torch.bfloat16 if m["bf16"] else torch.float32
    gdt = torch.float32
    dtypes = (pdt, gdt)
    bucket_size = max(40_000_000, 1_000_000 * dp) if m["overlap_grad_reduce"] else None
    folder = os.path.join(root, "iter_0000001")
    os.makedirs(folder, exist_ok=True)
    L = m["num_layers"]
    extra_blob = blobs["decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"]
    rerun_blob = blobs["rerun_state_machine_state/shard_0_8"]
    rng_blob = blobs["rng_state/shard_0.0_2.2"]
    optim_blob = blobs["optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"]
    # the real bytes where the sizes are the real case's (re-pickling is equal in content, not in
    # bytes: pickle's memo sharing of the interned argument names differs)
    common_blob = (blobs["common_state/shard_0_1"] if (m, tp, pp, dp) == (LIKE_REAL, 2, 2, 2)
                   else common_state(blobs["common_state/shard_0_1"], m, tp, pp, dp))

    # per rank: [(key, "bytes", blob) | (key, "shard", offsets, sizes, global shape, dtype)] in state-dict order
    items: list[list] = [[] for _ in range(world)]
    for p in range(pp):
        params = _params(m, tp, p, pp)
        for t in range(tp):
            ranks = [t + tp * (d + dp * p) for d in range(dp)]
            g = t + tp * p
            # the model: every DP rank holds every shard; main replicas in the TP-0 domain for norms
            model = []  # (key, kind, ...) in traversal order, before distribution
            for key, shape, layer, split in params:
                if split is not None or t == 0:
                    for off, sz in _shards(key, shape, layer, split, t, tp):
                        model.append((key, "shard", off, sz, shape, pdt))
                if key in _EXTRA and t == 0:
                    k = f"{_EXTRA[key]}/shard_{layer}_{L}"
                    model.append((k, "bytes", blobs.get(k, extra_blob)))
            # the optimizer buckets
            local = [sum(_numel(sz) for _off, sz in _shards(key, shape, layer, split, t, tp))
                     for key, shape, layer, split in params]
            where, buckets, unpadded = _buckets(local, dp, bucket_size)
            opt = {d: [] for d in range(dp)}
            for k, (bs, be) in enumerate(buckets):
                cuts = _bucket_chunks(where, k, bs, be, unpadded[k], dp)
                for kind in ("param", "exp_avg", "exp_avg_sq"):
                    key = (f"optimizer.distributed.dp_group_idx_{g}.gbuf_idx_0.dtype_{dtypes}"
                           f".bucket_idx_{k}.{kind}")
                    for d in range(dp):
                        for off, n in cuts[d]:
                            opt[d].append((key, "shard", (off,), (n,), (unpadded[k],), gdt))
            # distribution of the main replicas over the DP ranks (the optimizer's chunks have one holder)
            to_ranks, to_size = {}, {}
            for d in range(dp):
                for it in opt[d]:
                    to_ranks[(it[0], it[2], None)] = (d,)
                    to_size[(it[0], it[2], None)] = _numel(it[3]) * 4
            for it in model:
                if it[1] == "shard":
                    to_ranks[(it[0], it[2], None)] = tuple(range(dp))
                    to_size[(it[0], it[2], None)] = _numel(it[3]) * (2 if it[5] == torch.bfloat16 else 4)
            saver = _distribute(to_ranks, to_size, dp) if dp > 1 else {s: 0 for s in to_ranks}
            for d, r in enumerate(ranks):
                mine = [it for it in model if (it[1] == "bytes" and d == 0) or
                        (it[1] == "shard" and saver[(it[0], it[2], None)] == d)]
                if d == 0:
                    k = f"optimizer.distributed.dp_group_idx_{g}.optimizer/shard_0_1"
                    mine += [(k, "bytes", blobs.get(k, optim_blob)),
                             (f"optimizer.distributed.dp_group_idx_{g}.per_bucket_numel/shard_0_1", "bytes",
                              per_bucket(dtypes, [be - bs for bs, be in buckets])),
                             (f"optimizer.distributed.dp_group_idx_{g}.per_bucket_numel_unpadded/shard_0_1", "bytes",
                              per_bucket(dtypes, unpadded))]
                mine += opt[d]
                k = f"rerun_state_machine_state/shard_{r}_{world}"
                mine.append((k, "bytes", blobs.get(k, rerun_blob)))
                if d == 0:
                    k = f"rng_state/shard_{p}.{t}_{pp}.{tp}"
                    mine.append((k, "bytes", blobs.get(k, rng_blob)))
                if r == 0:
                    mine.append(("common_state/shard_0_1", "bytes", common_blob))
                items[r] = mine
    log(f"  layout of {world} ranks: {time.perf_counter() - t0:.1f} s")

    plans, results, data_bytes = [], [], 0
    md: dict = {}
    for r in range(world):
        # a key's chunks together, keys in order of first appearance (LocalShardsContainer)
        order: dict = {}
        for it in items[r]:
            order.setdefault(it[0], []).append(it)
        names = {k: scale_dcp.fresh(k) for k in order}
        witems = []
        for key, its in order.items():
            for i, it in enumerate(its):
                if it[1] == "bytes":
                    witems.append((WriteItem(index=MetadataIndex(names[key]), type=WriteItemType.BYTE_IO), it))
                    continue
                off = torch.Size(it[2])
                td = TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(it[3])),
                                     properties=TensorProperties(dtype=it[5]), size=torch.Size(it[4]))
                idx = MetadataIndex(names[key], off, i if len(its) > 1 else None)
                witems.append((WriteItem(index=idx, type=WriteItemType.SHARD, tensor_data=td), it))
        plans.append(SavePlan(items=[w for w, _ in witems], storage_data=None, planner_data={}, usable=True))
        for w, _ in witems:
            if w.type == WriteItemType.BYTE_IO:
                md[w.index.fqn] = BytesStorageMetadata()
            else:
                e = md.get(w.index.fqn)
                if e is None:
                    e = md[w.index.fqn] = TensorStorageMetadata(properties=w.tensor_data.properties,
                                                                size=w.tensor_data.size, chunks=[])
                e.chunks.append(w.tensor_data.chunk)
        ordered = [x for x in witems if x[0].type == WriteItemType.BYTE_IO] + \
                  [x for x in witems if x[0].type != WriteItemType.BYTE_IO]
        pieces = []
        for _w, it in ordered:
            if it[1] == "bytes":
                pieces.append((len(it[2]), ((0, it[2]),), False))
            else:
                pieces.append((*scale_dcp.zeros_archive(tuple(it[3]), it[5]), True))
        file_name = f"__{r}_0.distcp"
        spans = scale_dcp.write_rank_file(os.path.join(folder, file_name), pieces, holes=holes)
        res = []
        # the results are gathered apart from the plans: one fresh string a key, shared by the rank's results
        again = {k: scale_dcp.fresh(k) for k in order}
        for (w, _it), (at, n) in zip(ordered, spans, strict=True):
            i = w.index
            idx = MetadataIndex(again[i.fqn], i.offset, i.index) if i.offset is not None \
                else MetadataIndex(again[i.fqn])
            res.append(WriteResult(index=idx, size_in_bytes=n, storage_data=_StorageInfo(file_name, at, n)))
        results.append(res)
        data_bytes += spans[-1][0] + spans[-1][1] if spans else 0
        if r % 128 == 127:
            log(f"  rank {r + 1}/{world}: {time.perf_counter() - t0:.0f} s")
    metadata = Metadata(state_dict_metadata=md, planner_data=None)
    metadata.all_local_plans = plans
    writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=False)
    writer.set_up_storage_writer(True)
    if save_id is not None:
        writer.save_id = save_id
    # megatron's writer names the checkpoint by its str path (torch's own by a Path)
    writer.storage_meta = lambda: type(writer).storage_meta(writer).__class__(
        checkpoint_id=checkpoint_id or folder, save_id=writer.save_id)
    writer.finish(metadata=metadata, results=results)
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    info = {"ranks": world, "tp": tp, "pp": pp, "dp": dp,
            "tensors": sum(1 for e in md.values() if hasattr(e, "chunks")),
            "chunks": sum(len(e.chunks) for e in md.values() if hasattr(e, "chunks")),
            "byte_items": sum(1 for e in md.values() if not hasattr(e, "chunks")),
            "metadata_bytes": os.path.getsize(os.path.join(folder, ".metadata")),
            "data_bytes": data_bytes, "seconds": time.perf_counter() - t0, "writer": "scale_torch_dist"}
    with open(os.path.join(root, "scale_source.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def describe(folder: str) -> dict:
    """What `compare` compares of a torch_dist `.metadata` (read by torch): the keys in order,
    each tensor's size, dtype and chunk boxes in order, every storage entry, every rank's plan."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(folder).read_metadata()
    keys = []
    for k, e in md.state_dict_metadata.items():
        if hasattr(e, "chunks"):
            keys.append((k, tuple(e.size), str(e.properties.dtype),
                         tuple((tuple(c.offsets), tuple(c.sizes)) for c in e.chunks)))
        else:
            keys.append((k, "bytes"))

    def ix(i):
        return (i.fqn, None if i.offset is None else tuple(i.offset), i.index)

    storage = [(ix(i), s.relative_path, s.offset, s.length) for i, s in md.storage_data.items()]
    plans = [[(ix(w.index), w.type.name, None if w.tensor_data is None else
               (tuple(w.tensor_data.chunk.offsets), tuple(w.tensor_data.chunk.sizes), tuple(w.tensor_data.size),
                str(w.tensor_data.properties.dtype))) for w in p.items] + [p.storage_data, p.planner_data, p.usable]
             for p in md.all_local_plans]
    return {"keys": keys, "storage": storage, "plans": plans, "planner_data": md.planner_data,
            "version": md.version}


def compare(a: dict, b: dict) -> list[str]:
    """The differences between two `describe`s (empty: the same)."""
    bad = []
    for part in ("keys", "storage", "plans", "planner_data", "version"):
        if a[part] != b[part]:
            x, y = a[part], b[part]
            if isinstance(x, list) and isinstance(y, list):
                first = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
                bad.append(f"{part}: {len(x)} vs {len(y)} entries, first difference at {first}: "
                           f"{x[first] if first < len(x) else None!r} vs {y[first] if first < len(y) else None!r}")
            else:
                bad.append(f"{part}: {x!r} vs {y!r}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=9)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--like-real", action="store_true", help="the real case's model at TP 2 x PP 2 x DP 2")
    ap.add_argument("--check", help="a real iter_N folder to compare the written .metadata with")
    ap.add_argument("--holes", action="store_true", help="leave every tensor a hole (metadata benchmarks)")
    a = ap.parse_args(argv)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    if a.like_real:
        info = write(a.dir, LIKE_REAL, 2, 2, 2, holes=a.holes, log=log)
    else:
        info = write(a.dir, LLAMA_405B, a.tp, a.pp, a.dp, holes=a.holes, log=log)
    if a.check:
        bad = compare(describe(a.check), describe(os.path.join(a.dir, "iter_0000001")))
        info["differences"] = bad
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
