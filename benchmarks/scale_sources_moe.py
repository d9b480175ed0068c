"""A sparse DCP checkpoint shaped like a torchtitan 0.3 DeepSeek V3 671B run with EP, written by torch.

`scale_sources.py` writes a Llama FSDP2 run as `{"model": ..., "optim": ...}`; torchtitan 0.3 saves
differently, as its real MoE checkpoint `tests/real/cases/torchtitan_qwen3_moe` shows (torchtitan
0.3.0, torch 2.13):

- the model's keys at the TOP level (`tok_embeddings.weight`, `layers.3.moe.routed_experts.
  inner_experts.w1_EFD`), the routed experts stacked `[E, F, D]` / `[E, D, F]`, the persistent
  `moe.expert_bias_E` buffer saved with the params;
- the optimizer FLATTENED (`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`):
  `optimizer.state.<fqn>.exp_avg` / `.exp_avg_sq` (DTensors like the param) / `.step` (a 0-d
  tensor), and `optimizer.param_groups.<fqn>.<key>` for each of AdamW's 12 group keys (`lr`,
  `betas`, ..., `initial_lr`): one byte item per param per key;
- `train_state.step`, `train_state.ntokens_seen`, `lr_scheduler.last_epoch` (byte items),
  `dataloader.world_size` and one `dataloader.dp_rank_{r}` per rank.

The names and shapes are those of torchtitan 0.3.0's own `deepseek_v3` `671B` model (built on the
meta device: 967 params + 58 `expert_bias_E`, 1025 tensors). Sharding: torchtitan's FSDP2 Shard(0)
over all ranks for every non-expert tensor; the routed experts Shard(0) over EP and again over the
expert-FSDP ranks (`efsdp = world / ep`), the EP shard first, as the real file's chunk order shows
(rank r holds expert block `ep_rank * E/ep + efsdp_rank * E/world`, with `r = efsdp_rank * ep +
ep_rank`). The `.metadata` is written by torch's own `DefaultSavePlanner` and `FileSystemWriter`
(`scale_sources.ShardProxy` builds each rank's write items as DTensor does); `.distcp` files are
sparse.

    python benchmarks/scale_sources_moe.py DIR --ranks 64 --ep 64
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_dcp  # noqa: E402
from scale_sources import ShardProxy, coordinate, finish, rank_plan  # noqa: E402

DSV3_671B = {  # torchtitan 0.3.0 models/deepseek_v3/__init__.py `_671b`
    "dim": 7168, "dense_hidden_dim": 18432, "moe_hidden_dim": 2048, "n_layers": 61,
    "n_dense_layers": 3, "n_heads": 128, "num_experts": 256, "num_shared_experts": 1,
    "vocab_size": 129280, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
}
# AdamW's param-group keys as torch 2.13 saves them in the flattened optimizer state (the real
# torchtitan file's `optimizer.param_groups.<fqn>.*`), `params` excluded
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
              "differentiable", "fused", "decoupled_weight_decay", "initial_lr")


def titan_dsv3_tensors(c: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(fqn, shape, is_param) of torchtitan 0.3's DeepSeek V3 state dict, in its order."""
    d, h = c["dim"], c["n_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    e, f, fd = c["num_experts"], c["moe_hidden_dim"], c["dense_hidden_dim"]
    fs = f * c["num_shared_experts"]
    out = [("tok_embeddings.weight", (c["vocab_size"], d), True)]
    for i in range(c["n_layers"]):
        p = f"layers.{i}."
        out += [(p + n, s, True) for n, s in [
            ("attention.wq_a.weight", (c["q_lora_rank"], d)),
            ("attention.q_norm.weight", (c["q_lora_rank"],)),
            ("attention.wq_b.weight", (h * qk, c["q_lora_rank"])),
            ("attention.wkv_a.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], d)),
            ("attention.kv_norm.weight", (c["kv_lora_rank"],)),
            ("attention.wkv_b.weight", (h * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
            ("attention.wo.weight", (d, h * c["v_head_dim"])),
            ("attention_norm.weight", (d,)),
            ("ffn_norm.weight", (d,)),
        ]]
        if i < c["n_dense_layers"]:
            out += [(p + "feed_forward.w1.weight", (fd, d), True), (p + "feed_forward.w2.weight", (d, fd), True),
                    (p + "feed_forward.w3.weight", (fd, d), True)]
        else:
            out += [
                (p + "moe.expert_bias_E", (e,), False),
                (p + "moe.routed_experts.inner_experts.w1_EFD", (e, f, d), True),
                (p + "moe.routed_experts.inner_experts.w2_EDF", (e, d, f), True),
                (p + "moe.routed_experts.inner_experts.w3_EFD", (e, f, d), True),
                (p + "moe.router.gate.weight", (e, d), True),
                (p + "moe.shared_experts.w1.weight", (fs, d), True),
                (p + "moe.shared_experts.w2.weight", (d, fs), True),
                (p + "moe.shared_experts.w3.weight", (fs, d), True),
            ]
    out += [("norm.weight", (d,), True), ("lm_head.weight", (c["vocab_size"], d), True)]
    return out


@dataclasses.dataclass(frozen=True)
class _Layout:
    mesh: tuple[int, ...]
    shard_dims: tuple[int, ...]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """`rank`'s place on this mesh: (ep, efsdp) with the EP rank fastest, or (rank,)."""
        return (rank % self.mesh[0], rank // self.mesh[0]) if len(self.mesh) == 2 else (rank,)


def _shard(fqn: str, shape, rank: int, world: int, ep: int):
    """(layout, coordinate) of `rank`'s shard of `fqn` (see the module docstring)."""
    if ".routed_experts." in fqn:
        efsdp = world // ep
        # DTensor applies the outer mesh dim first: mesh (ep, efsdp), both Shard(0)
        return _Layout((ep, efsdp), (0, 0)), (rank % ep, rank // ep)
    return _Layout((world,), (0,)), (rank,)


def rank_state_dict(tensors, rank: int, world: int, ep: int, group: dict) -> dict:
    """The state dict torchtitan 0.3's CheckpointManager hands `dcp.save` on rank `rank`."""
    import torch

    sd: dict = {}
    optim: dict = {}
    for fqn, shape, is_param in tensors:
        lay, coord = _shard(fqn, shape, rank, world, ep)  # (`write_fast` asks `lay.coordinate`)
        sd[fqn] = ShardProxy(shape, torch.float32, lay, coord)
        if not is_param:
            continue
        optim[f"state.{fqn}.exp_avg"] = ShardProxy(shape, torch.float32, lay, coord)
        optim[f"state.{fqn}.exp_avg_sq"] = ShardProxy(shape, torch.float32, lay, coord)
        optim[f"state.{fqn}.step"] = torch.tensor(1000.0)
        for k in GROUP_KEYS:
            optim[f"param_groups.{fqn}.{k}"] = group[k]
    sd["optimizer"] = optim
    sd["lr_scheduler"] = {"last_epoch": 1000}
    sd["dataloader"] = {"world_size": world, f"dp_rank_{rank}": b"\x00" * 256}
    sd["train_state"] = {"step": 1000, "ntokens_seen": 65536000000}
    return sd


def adamw_group() -> dict:
    """torch.optim.AdamW's param group (lr 2.2e-4, as torchtitan's DeepSeek V3 671B toml)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    g = dict(torch.optim.AdamW([p], lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1).param_groups[0])
    g.pop("params")
    g["initial_lr"] = g["lr"]
    return g


def write_fast(root: str, world: int, ep: int, *, holes: bool = False, save_id: str | None = None,
               log=print, config: dict = DSV3_671B) -> dict:
    """The same checkpoint without the planner (`scale_dcp.write_items`: torch's `Metadata`
    objects built directly, `.metadata` equal byte for byte, `check`), each tensor's `torch.save`
    archive headers written unless `holes` (a plan parses them; `write` leaves them holes)."""
    if world % ep:
        raise SystemExit(f"--ranks {world} is not a multiple of --ep {ep}")
    tensors, group = titan_dsv3_tensors(config), adamw_group()
    items, mappings = scale_dcp.flat_items_of(rank_state_dict(tensors, 0, world, ep, group))
    own = "dataloader.dp_rank_0"
    items = [("dataloader.dp_rank_{rank}", "rank_bytes", v) if f == own else (f, k, v) for f, k, v in items]

    def rank_mappings(r: int) -> dict:  # rank r's: its own dp_rank key in rank 0's place
        return {(f"dataloader.dp_rank_{r}" if k == own else k): (v[:1] + (f"dp_rank_{r}",) if k == own else v)
                for k, v in mappings.items()}

    info = scale_dcp.write_items(root, items, mappings, world, rank_mappings=rank_mappings, holes=holes,
                                 save_id=save_id, log=log)
    info.update(model="torchtitan 0.3 deepseek_v3 671B", ep=ep, byte_items=len(items) - info["tensors"])
    with open(os.path.join(root, "scale_source.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def check(root: str, world: int, ep: int, log=print, config: dict = DSV3_671B) -> dict:
    """`write` (torch's planner for every rank) and `write_fast` at `root` with one save id: the
    `.metadata` and every `.distcp` must be equal (tensors as holes in both)."""
    import shutil
    import uuid

    save_id, got = str(uuid.uuid4()), {}
    for name, fn in (("planner", write), ("fast", lambda *a, **k: write_fast(*a, holes=True, **k))):
        shutil.rmtree(root, ignore_errors=True)
        info = fn(root, world, ep, save_id=save_id, log=log, config=config)
        got[name] = {f: scale_dcp._digest(open(os.path.join(root, f), "rb")) for f in sorted(os.listdir(root))
                     if f.endswith(".distcp") or f == ".metadata"}
        log(f"  {name}: {info['seconds']:.1f} s, .metadata {info['metadata_bytes']} bytes")
    bad = [f for f in got["planner"] if got["planner"][f] != got["fast"].get(f)]
    if bad or len(got["fast"]) != len(got["planner"]):
        raise AssertionError(f"{world} ranks: the fast path differs from the planner path in {bad[:5]}")
    return {"ranks": world, "ep": ep, "files": len(got["fast"]), "identical": True}


def write(root: str, world: int, ep: int, save_id: str | None = None, log=print, config: dict = DSV3_671B) -> dict:
    """The sparse checkpoint of `world` ranks (EP `ep`) at `root`; returns counts and sizes."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    if world % ep:
        raise SystemExit(f"--ranks {world} is not a multiple of --ep {ep}")
    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    tensors = titan_dsv3_tensors(config)
    group = adamw_group()
    local_plans, values = [], {}
    for r in range(world):
        planner = DefaultSavePlanner()
        planner.set_up_planner(rank_state_dict(tensors, r, world, ep, group), None, r == 0)
        plan = planner.create_local_plan()
        for item in plan.items:  # the values rank r writes itself (bytes, plain tensors)
            if item.type == WriteItemType.BYTE_IO or item.tensor_data.chunk.sizes == torch.Size([]):
                values.setdefault(item.index.fqn, planner.state_dict[item.index.fqn])
        local_plans.append(pickle.loads(pickle.dumps(plan)))  # gather_object: pickled per rank
    coordinator, writer, global_plans, metadata = coordinate(
        root, rank_state_dict(tensors, 0, world, ep, group), local_plans, save_id=save_id
    )
    del local_plans
    log(f"  plans of {world} ranks: {time.perf_counter() - t0:.0f} s")
    results, sizes, written = [], {}, {}
    for r, plan in enumerate(global_plans):
        plan, file_name, items = rank_plan(plan, r)
        offset, out, blobs = 0, [], []
        for item in items:
            v = values.get(item.index.fqn)
            if item.type == WriteItemType.BYTE_IO or isinstance(v, torch.Tensor):  # real bytes
                buf = io.BytesIO()
                if isinstance(v, io.BytesIO):
                    buf.write(v.getvalue())
                else:
                    torch.save(v, buf)
                length = buf.tell()
                blobs.append((offset, buf.getvalue()))
            else:  # the length of torch.save's archive of the shard (`scale_dcp.zeros_archive`)
                length = scale_dcp.zeros_archive(tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype)[0]
            out.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(file_name, offset, length)))
            offset += length
        sizes[file_name] = offset
        written[file_name] = blobs
        results.append(pickle.loads(pickle.dumps(out)))  # gather_object: pickled per rank
        global_plans[r] = None
    finish(root, writer, metadata, results, sizes, written)
    md = metadata.state_dict_metadata.values()
    info = {
        "model": "torchtitan 0.3 deepseek_v3 671B",
        "ranks": world,
        "ep": ep,
        "tensors": sum(1 for e in md if hasattr(e, "chunks")),
        "byte_items": sum(1 for e in md if not hasattr(e, "chunks")),
        "chunks": sum(len(e.chunks) for e in md if hasattr(e, "chunks")),
        "metadata_bytes": os.path.getsize(os.path.join(root, ".metadata")),
        "data_bytes": sum(sizes.values()),
        "seconds": time.perf_counter() - t0,
    }
    with open(os.path.join(root, "scale_source.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--planner", action="store_true", help="torch's planner for every rank (slow; tensors holes)")
    ap.add_argument("--holes", action="store_true", help="no archive headers either (metadata rows only)")
    ap.add_argument("--check", action="store_true", help="write by the planner and the fast path, compare bytes")
    a = ap.parse_args(argv)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    if a.check:
        print(json.dumps(check(a.dir, a.ranks, a.ep, log=log)))
    elif a.planner:
        print(json.dumps(write(a.dir, a.ranks, a.ep, log=log)))
    else:
        print(json.dumps(write_fast(a.dir, a.ranks, a.ep, holes=a.holes, log=log)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
