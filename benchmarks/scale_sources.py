"""Sparse DCP checkpoints shaped like real runs, their `.metadata` written by torch itself.

A DCP save of W ranks is, per rank, a local plan (`DefaultSavePlanner.create_local_plan`: one
`WriteItem` per DTensor shard, plain tensor and non-tensor value), gathered to the coordinator
(`_DistWrapper.reduce_scatter`: each plan pickled and unpickled), turned into the global plan
and the `Metadata` (`DefaultSavePlanner.create_global_plan`: deduplication,
`create_default_global_save_plan`, the flattened-key mappings as `planner_data`, validation),
scattered back; each rank writes its items into `__{rank}_0.distcp` (byte items first, then
tensors, each a `torch.save` archive) and returns `WriteResult`s (gathered again: pickled and
unpickled); `FileSystemWriter.finish` pickles the `Metadata` with them into `.metadata`.

This module runs every one of those steps with torch's own code for each rank in one process,
with one substitution: a rank's shard of a parameter is `ShardProxy`, which builds the write
item exactly as torch's `_create_write_items_for_dtensor` does (torch's own
`_compute_local_shape_and_global_offset` on the rank's mesh coordinate), without a process
group or any tensor memory. The gathers are reproduced by pickling and unpickling each rank's
plan and results as `gather_object` does (so objects are shared within a rank's results and not
across ranks, as in a real run). Each `.distcp` file is then created sparse at its size: every
byte range the metadata names exists and reads as zeros; the data is never read by the
metadata benchmarks (byte items, the param-group values, and the plain step tensors are written for real). A chunk's length is its tensor bytes plus the archive overhead torch.save
adds for a tensor of its dims and dtype (measured once per kind).

Shapes (`llama405b`, `deepseek_v3_671b`): the published HF configs of Llama 3.1 405B and
DeepSeek V3. FSDP2 shards every parameter and moment on dim 0 over all ranks (torch.chunk
sizes: uneven dims leave the last ranks short or empty, as DTensor does); DeepSeek's routed
experts (torchtitan's grouped `moe.experts.w1/w2/w3` `[experts, ...]`) are sharded on dim 0 over
the EP ranks and on dim 1 over the rest, like torchtitan's EP x FSDP.

    python benchmarks/scale_sources.py DIR --ranks 64 [--model llama405b|deepseek_v3_671b] [--params-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pickle
import sys
import time
from dataclasses import dataclass

LLAMA_405B = {  # meta-llama/Llama-3.1-405B config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def llama_params(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of a Llama config (`[out, in]` weights)."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, d)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
            (p + "input_layernorm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (d,)),
        ]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]
    return out


DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (the parts that shape the tensors)
    "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61, "n_dense_layers": 3,
    "n_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "vocab_size": 129280,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def deepseek_params(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """torchtitan's DeepSeek V3 names and shapes (`[out, in]`; grouped experts `[E, ...]`)."""
    d, h = c["dim"], c["n_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = [("tok_embeddings.weight", (c["vocab_size"], d))]
    for i in range(c["n_layers"]):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq_a.weight", (c["q_lora_rank"], d)),
            (p + "attention.q_norm.weight", (c["q_lora_rank"],)),
            (p + "attention.wq_b.weight", (h * qk, c["q_lora_rank"])),
            (p + "attention.wkv_a.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], d)),
            (p + "attention.kv_norm.weight", (c["kv_lora_rank"],)),
            (p + "attention.wkv_b.weight", (h * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
            (p + "attention.wo.weight", (d, h * c["v_head_dim"])),
            (p + "attention_norm.weight", (d,)),
            (p + "ffn_norm.weight", (d,)),
        ]
        if i < c["n_dense_layers"]:
            f = c["inter_dim"]
            out += [(p + "feed_forward.w1.weight", (f, d)), (p + "feed_forward.w2.weight", (d, f)),
                    (p + "feed_forward.w3.weight", (f, d))]
        else:
            e, f, fs = c["n_routed_experts"], c["moe_inter_dim"], c["moe_inter_dim"] * c["n_shared_experts"]
            out += [
                (p + "moe.router.gate.weight", (e, d)),
                (p + "moe.expert_bias", (e,)),
                (p + "moe.experts.w1", (e, f, d)),
                (p + "moe.experts.w2", (e, d, f)),
                (p + "moe.experts.w3", (e, f, d)),
                (p + "moe.shared_experts.w1.weight", (fs, d)),
                (p + "moe.shared_experts.w2.weight", (d, fs)),
                (p + "moe.shared_experts.w3.weight", (fs, d)),
            ]
    out += [("norm.weight", (d,)), ("output.weight", (c["vocab_size"], d))]
    return out


@dataclass(frozen=True)
class Layout:
    """How a parameter is sharded: over a mesh of `mesh` sizes, `placements` (torch `Shard`s)."""

    mesh: tuple[int, ...]
    shard_dims: tuple[int, ...]  # per mesh dim, the tensor dim it shards


class ShardProxy:
    """One rank's shard of a DTensor, as DCP's planner sees it: `__create_write_items__` builds the
    write item exactly as torch's `_create_write_items_for_dtensor` does, from torch's own
    `_compute_local_shape_and_global_offset` at this rank's mesh coordinate."""

    def __init__(self, shape, dtype, layout: Layout, coordinate):
        self.shape, self.dtype, self.layout, self.coordinate = shape, dtype, layout, coordinate

    def __create_write_items__(self, fqn, obj):
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        sizes, offsets = _compute_local_shape_and_global_offset(
            self.shape, self.layout.mesh, list(self.coordinate), [Shard(d) for d in self.layout.shard_dims]
        )
        sizes, offsets = torch.Size(sizes), torch.Size(offsets)
        return [WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties(dtype=self.dtype),
                size=torch.Size(self.shape),
            ),
        )]


def _coordinate(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(mesh):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


_OVERHEAD: dict = {}


def _archive_overhead(dtype, ndim: int) -> int:
    """Bytes torch.save adds around a tensor's data (a small tensor of `ndim` dims, measured)."""
    import torch

    key = (dtype, ndim)
    if key not in _OVERHEAD:
        t = torch.zeros((1,) * ndim, dtype=dtype)
        buf = io.BytesIO()
        torch.save(t, buf)
        _OVERHEAD[key] = buf.tell() - t.element_size()
    return _OVERHEAD[key]


def _item_length(item) -> int:
    import torch
    from torch.distributed.checkpoint.planner import WriteItemType

    if item.type == WriteItemType.BYTE_IO:
        return 0
    c = item.tensor_data.chunk
    dt = item.tensor_data.properties.dtype
    n = 1
    for s in c.sizes:
        n *= s
    return n * torch.empty((), dtype=dt).element_size() + _archive_overhead(dt, len(c.sizes))


def rank_state_dict(params, layouts, rank: int, *, moments: bool, param_groups: dict | None):
    """The state dict rank `rank` hands to `dcp.save`: `{"model": ..., "optim": {"state": ...,
    "param_groups": [...]}}` as `get_state_dict` gives it (moments and step per param)."""
    import torch

    model, state = {}, {}
    for name, shape in params:
        lay = layouts(name, shape)
        coord = _coordinate(rank, lay.mesh)
        model[name] = ShardProxy(shape, torch.float32, lay, coord)
        if moments:
            state[name] = {
                "step": torch.tensor(1000.0),
                "exp_avg": ShardProxy(shape, torch.float32, lay, coord),
                "exp_avg_sq": ShardProxy(shape, torch.float32, lay, coord),
            }
    sd = {"model": model}
    if moments:
        sd["optim"] = {"state": state, "param_groups": [dict(param_groups, params=[n for n, _ in params])]}
    return sd


def adamw_group() -> dict:
    """torch.optim.AdamW's param group keys and defaults (lr 3e-4, weight decay 0.1)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    g = dict(torch.optim.AdamW([p], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1).param_groups[0])
    g.pop("params")
    return g


def coordinate(root: str, state_dict0: dict, local_plans: list, save_id: str | None = None):
    """Rank 0's part of a DCP save: its `DefaultSavePlanner` (set up on `state_dict0`) merges the
    ranks' `local_plans` and `FileSystemWriter(root)` prepares them, as `dcp.save` does; returns
    (coordinator, writer, global plans, metadata)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    coordinator = DefaultSavePlanner()
    coordinator.set_up_planner(state_dict0, None, True)
    writer = FileSystemWriter(root, single_file_per_rank=True, sync_files=False)
    writer.set_up_storage_writer(True)
    if save_id is not None:
        writer.save_id = save_id
    global_plans, metadata = coordinator.create_global_plan(local_plans)
    return coordinator, writer, writer.prepare_global_plan(global_plans), metadata


def rank_plan(plan, r: int):
    """Rank `r`'s global plan as it receives it (pickled, as scatter_object does), its `.distcp`
    file name, and its items in `FileSystemWriter`'s write order (byte items first)."""
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.planner import WriteItemType

    plan = pickle.loads(pickle.dumps(plan))
    prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _StoragePrefix) else f"__{r}_"
    items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
    items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
    return plan, f"{prefix}0.distcp", items


def finish(root: str, writer, metadata, results: list, sizes: dict, written: dict) -> None:
    """Rank 0's `writer.finish` (the `.metadata` of `metadata` and every rank's `results`), then
    each `.distcp` file sparse: `sizes[name]` bytes long, only its `written[name]` (offset, bytes)
    blobs written (byte items are real: small torch.save'd values), the rest holes."""
    writer.finish(metadata=dataclasses.replace(metadata), results=results)
    for name, n in sizes.items():
        with open(os.path.join(root, name), "wb") as f:
            for at, blob in written[name]:
                f.seek(at)
                f.write(blob)
            f.truncate(n)


def write(root: str, params, layouts, world: int, *, moments: bool = True, config: dict | None = None,
          log=print) -> dict:
    """The sparse DCP checkpoint of `world` ranks at `root`; returns counts and sizes."""

    import torch  # noqa: F401
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    group = adamw_group() if moments else None
    local_plans = []
    for r in range(world):
        planner = DefaultSavePlanner()
        planner.set_up_planner(rank_state_dict(params, layouts, r, moments=moments, param_groups=group),
                               None, r == 0)
        plan = planner.create_local_plan()
        local_plans.append(pickle.loads(pickle.dumps(plan)))  # gather_object: pickled per rank
    coordinator, writer, global_plans, metadata = coordinate(
        root, rank_state_dict(params, layouts, 0, moments=moments, param_groups=group), local_plans
    )
    del local_plans
    log(f"  plans of {world} ranks: {time.perf_counter() - t0:.0f} s")
    results, sizes, written = [], {}, {}
    for r, plan in enumerate(global_plans):
        plan, file_name, items = rank_plan(plan, r)
        offset, out, blobs = 0, [], []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(_byte_value(coordinator, item.index.fqn), buf)
                length = buf.tell()
                blobs.append((offset, buf.getvalue()))
            elif isinstance(_byte_value(coordinator, item.index.fqn), torch.Tensor):  # step: real
                buf = io.BytesIO()
                torch.save(_byte_value(coordinator, item.index.fqn), buf)
                length = buf.tell()
                blobs.append((offset, buf.getvalue()))
            else:
                length = _item_length(item)
            out.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(file_name, offset, length)))
            offset += length
        sizes[file_name] = offset
        written[file_name] = blobs
        results.append(pickle.loads(pickle.dumps(out)))  # gather_object: pickled per rank
        global_plans[r] = None
    finish(root, writer, metadata, results, sizes, written)
    if config is not None:
        with open(os.path.join(root, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    chunks = sum(len(e.chunks) for e in metadata.state_dict_metadata.values() if hasattr(e, "chunks"))
    info = {
        "ranks": world,
        "tensors": sum(1 for e in metadata.state_dict_metadata.values() if hasattr(e, "chunks")),
        "chunks": chunks,
        "metadata_bytes": os.path.getsize(os.path.join(root, ".metadata")),
        "data_bytes": sum(sizes.values()),
        "seconds": time.perf_counter() - t0,
    }
    with open(os.path.join(root, "scale_source.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def _byte_value(planner, fqn: str):
    """A non-tensor value of the coordinator's flattened state dict (a param-group entry)."""
    return planner.state_dict[fqn]


def fsdp(world: int):
    """FSDP2: every parameter and moment Shard(0) over all `world` ranks."""
    lay = Layout((world,), (0,))
    return lambda name, shape: lay


def ep_fsdp(world: int, ep: int):
    """torchtitan EP x FSDP: routed experts `[E, ...]` Shard(0) over `ep` ranks and Shard(1) over
    the other `world // ep`; everything else Shard(0) over all ranks."""
    dense = Layout((world,), (0,))
    experts = Layout((ep, world // ep), (0, 1))
    return lambda name, shape: experts if ".moe.experts." in name else dense


MODELS = {
    "llama405b": (lambda: llama_params(LLAMA_405B), LLAMA_405B),
    "deepseek_v3_671b": (lambda: deepseek_params(DEEPSEEK_V3), None),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama405b")
    ap.add_argument("--ep", type=int, default=64, help="expert-parallel ranks (deepseek_v3_671b)")
    ap.add_argument("--params-only", action="store_true", help="no optimizer state")
    a = ap.parse_args(argv)
    make, cfg = MODELS[a.model]
    layouts = ep_fsdp(a.ranks, a.ep) if a.model.startswith("deepseek") else fsdp(a.ranks)
    info = write(a.dir, make(), layouts, a.ranks, moments=not a.params_only, config=cfg,
                 log=lambda s: print(s, file=sys.stderr))
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
