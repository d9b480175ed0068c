"""Small, valid checkpoints of every format, written once per test session (or benchmark run)
and copied before each damage or crash case.

`build_sources(root)` writes them under `root` in a second or two and returns name -> folder:
HF from the packaged sample, Megatron / Meta / Paddle / Colossal by the fixture writers, DCP
and DeepSpeed ZeRO-2 here (torch's own DCP metadata classes and `torch.save`, the layouts the
real tools write; tests/formats/test_dcp.py and tests/formats/test_deepspeed.py cover the real tools' files). `shared_sources(tmp_path_factory)` does it once per test run even under
pytest-xdist: the first worker builds under the run's shared temp dir while holding a lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import shutil

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCES = (
    "hf",
    "hf_sharded",
    "megatron",
    "meta",
    "dcp",
    "dcp_local",
    "deepspeed",
    "paddle",
    "paddle_unified",
    "colossal",
)

MEGATRON_LLAMA = dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=60)


def _hf(root: str) -> None:
    from hybridckpt.demo import sample_path

    shutil.copytree(sample_path(), os.path.join(root, "hf"))


def _hf_sharded(root: str) -> None:
    from hybridckpt.formats.hf.write import write_sharded
    from hybridckpt.formats.registry import open_source

    src = open_source(os.path.join(root, "hf"))
    out = os.path.join(root, "hf_sharded")
    os.makedirs(out)
    write_sharded(out, src.tensors, stem="model", max_shard_bytes=24 * 1024)
    shutil.copy(os.path.join(root, "hf", "config.json"), out)


def _megatron(root: str) -> None:
    from fixtures.megatron_writer import make_llama, write_megatron

    write_megatron(os.path.join(root, "megatron"), make_llama(**MEGATRON_LLAMA), tp=2, pp=2)


def _meta(root: str) -> None:
    from fixtures.meta_writer import meta_llama_reference, write_meta

    ref = meta_llama_reference(dim=32, layers=1, heads=4, kv_heads=2, vocab=64)
    write_meta(os.path.join(root, "meta"), ref, mp=2)


def _llama_ref(seed: int):
    from fixtures import paddle_writer as pw

    return pw.reference_llama(seed, vocab=30, hidden=16, mlp=24, layers=1, heads=2, kv_heads=2)


def _rows(n: int, ranks: int) -> list[tuple[int, int]]:
    """FSDP2's split of `n` rows over `ranks`: ceil(n / ranks) each, the last ones shorter."""
    per = -(-n // ranks)
    return [(min(r * per, n), min((r + 1) * per, n)) for r in range(ranks)]


def write_dcp(out: str, ref, *, ranks: int = 4, rank_local: bool = False) -> None:
    """A torch DCP checkpoint of `ref` as FSDP2 + `get_state_dict` saves it (`model.<fqn>`,
    `optim.state.<fqn>.{exp_avg, exp_avg_sq, step}`, `optim.param_groups.0.*`), each tensor
    split on dim 0 over `ranks` writers (uneven last chunk), written with torch's own metadata
    classes and `torch.save` per chunk (the `.distcp` layout of
    torch/distributed/checkpoint/filesystem.py). `rank_local`: `__R.metadata` per rank as with
    `use_collectives=False`. tests/formats/test_damaged.py checks torch's `dcp.load` reads it back."""
    import io

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    os.makedirs(out)
    tensors = {}
    for k, v in ref.params.items():
        tensors[f"model.{k}"] = torch.from_numpy(v)
        tensors[f"optim.state.{k}.exp_avg"] = torch.from_numpy(ref.exp_avg[k])
        tensors[f"optim.state.{k}.exp_avg_sq"] = torch.from_numpy(ref.exp_avg_sq[k])
        tensors[f"optim.state.{k}.step"] = torch.tensor(float(ref.step))
    items = {"optim.param_groups.0.lr": 1e-3, "optim.param_groups.0.betas": (0.9, 0.999),
             "optim.param_groups.0.eps": 1e-8, "optim.param_groups.0.weight_decay": 0.01,
             "optim.param_groups.0.params": list(ref.params)}
    files = [io.BytesIO() for _ in range(ranks)]
    per_rank = [(dict(), dict()) for _ in range(ranks)]  # (state_dict_metadata, storage_data)

    def put(r: int, index, obj) -> None:
        f = files[r]
        start = f.tell()
        torch.save(obj, f)
        per_rank[r][1][index] = _StorageInfo(f"__{r}_0.distcp", start, f.tell() - start)

    for fqn, t in tensors.items():
        props = TensorProperties(dtype=t.dtype)
        spans = _rows(t.shape[0], ranks) if t.ndim else [(0, 0)] * ranks
        for r, (a, b) in enumerate(spans):
            if t.ndim == 0 and r > 0 and not rank_local:
                break  # a replicated 0-d tensor is written once
            offs = torch.Size([a] + [0] * (t.ndim - 1)) if t.ndim else torch.Size([])
            block = t[a:b].clone() if t.ndim else t.clone()
            chunk = ChunkStorageMetadata(offs, block.shape)
            md = per_rank[r][0].setdefault(fqn, TensorStorageMetadata(props, t.shape, []))
            md.chunks.append(chunk)
            put(r, MetadataIndex(fqn, offs, 0), block)
    for fqn, value in items.items():
        per_rank[0][0][fqn] = BytesStorageMetadata()
        put(0, MetadataIndex(fqn), value)
    planner = {fqn: tuple(fqn.split(".", 1)) for fqn in list(tensors) + list(items)}
    for r, f in enumerate(files):
        with open(os.path.join(out, f"__{r}_0.distcp"), "wb") as fh:
            fh.write(f.getvalue())
    if rank_local:
        for r, (sdm, storage) in enumerate(per_rank):
            with open(os.path.join(out, f"__{r}.metadata"), "wb") as fh:
                pickle.dump(Metadata(sdm, planner, storage, version="1.0.0"), fh)
    else:
        sdm, storage = {}, {}
        for rank_sdm, rank_storage in per_rank:
            for fqn, m in rank_sdm.items():
                if fqn in sdm and isinstance(m, TensorStorageMetadata):
                    sdm[fqn].chunks.extend(m.chunks)
                else:
                    sdm[fqn] = m
            storage.update(rank_storage)
        with open(os.path.join(out, ".metadata"), "wb") as fh:
            pickle.dump(Metadata(sdm, planner, storage, version="1.0.0"), fh)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(ref.config, fh)


def _dcp(root: str) -> None:
    ref = _llama_ref(11)
    write_dcp(os.path.join(root, "dcp"), ref)
    write_dcp(os.path.join(root, "dcp_local"), ref, rank_local=True)


ZERO_GROUPS = [  # DeepSpeed param groups of a tiny model: numels not multiples of dp
    {"wte.weight": (37, 10), "fc1.weight": (13, 10), "fc2.weight": (10, 13)},
    {"fc1.bias": (13,), "ln_f.weight": (10,)},
]


def write_zero2(out: str, *, dp: int = 3, seed: int = 0) -> dict:
    """A DeepSpeed ZeRO-2 checkpoint as deepspeed/runtime/zero/stage_1_and_2.py `state_dict`
    saves it (`global_step3/`): per group the fp32 params flattened back to back, padded to a
    multiple of 2*dp, split in dp partitions with the padding stripped from the last one
    (`group_paddings`); the torch Adam state of each partition. Returns the reference
    {name: (fp32, exp_avg, exp_avg_sq)}."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    tag = os.path.join(out, "global_step3")
    os.makedirs(tag)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("global_step3")
    ref = {n: tuple(rng.standard_normal(s).astype(np.float32) for _ in range(3))
           for g in ZERO_GROUPS for n, s in g.items()}
    parts: list[list[dict]] = [[] for _ in range(dp)]
    for group in ZERO_GROUPS:
        flats = [np.concatenate([ref[n][i].reshape(-1) for n in group]) for i in range(3)]
        total = flats[0].size
        padded = -(-total // (2 * dp)) * (2 * dp)
        per = padded // dp
        for r in range(dp):
            a, b = r * per, min((r + 1) * per, total)
            parts[r].append({"pad": (r + 1) * per - b if r == dp - 1 else 0,
                             "t": [torch.from_numpy(f[a:b].copy()) for f in flats]})
    for r in range(dp):
        osd = {
            "zero_stage": 2,
            "partition_count": [dp] * len(ZERO_GROUPS),
            "single_partition_of_fp32_groups": [p["t"][0] for p in parts[r]],
            "group_paddings": [p["pad"] for p in parts[r]],
            "base_optimizer_state": {
                "state": {g: {"step": torch.tensor(3.0), "exp_avg": p["t"][1], "exp_avg_sq": p["t"][2]}
                          for g, p in enumerate(parts[r])},
                "param_groups": [{"params": [g], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                  "weight_decay": 0.01} for g in range(len(ZERO_GROUPS))],
            },
            "ds_version": "0.19.8",
        }
        torch.save({"optimizer_state_dict": osd},
                   os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    model = {
        "module": {n: torch.from_numpy(ref[n][0]).half() for g in ZERO_GROUPS for n in g},
        "buffer_names": [],
        "param_shapes": [dict(g) for g in ZERO_GROUPS],
        "frozen_param_shapes": None,
        "frozen_param_fragments": None,
        "shared_params": {},
        "global_steps": 3,
        "dp_world_size": dp,
        "mp_world_size": 1,
        "ds_version": "0.19.8",
    }
    torch.save(model, os.path.join(tag, "mp_rank_00_model_states.pt"))
    return ref


def _deepspeed(root: str) -> None:
    write_zero2(os.path.join(root, "deepspeed"))


def _paddle(root: str) -> None:
    from fixtures import paddle_writer as pw

    ref = pw.reference_llama(3, vocab=32, hidden=16, mlp=24, layers=1, heads=2, kv_heads=2)
    pw.write_hybrid(os.path.join(root, "paddle"), ref, pw.Options(tp=2, sharding=2, strategy="stage1"))
    pw.write_unified_fixture(os.path.join(root, "paddle_unified"), ref, bf16=True, shards=2)


def _colossal(root: str) -> None:
    from fixtures import colossal_writer as cw
    from fixtures import paddle_writer as pw

    ref = pw.reference_llama(5, vocab=32, hidden=16, mlp=24, layers=1, heads=2, kv_heads=2)
    out = os.path.join(root, "colossal")
    cw.write_colossal(out, ref.params, layers=1, tp=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(ref.config, f)


_BUILDERS = {
    "hf": _hf,
    "hf_sharded": _hf_sharded,
    "megatron": _megatron,
    "meta": _meta,
    "dcp": _dcp,
    "dcp_local": lambda root: None,  # written by _dcp
    "deepspeed": _deepspeed,
    "paddle": _paddle,
    "paddle_unified": lambda root: None,  # written by _paddle
    "colossal": _colossal,
}


def build_sources(root: str) -> dict[str, str]:
    """Write every source checkpoint under `root` (skipped when already complete)."""
    done = os.path.join(root, ".complete")
    if not os.path.exists(done):
        for name in SOURCES:
            _BUILDERS[name](root)
        with open(done, "w") as f:
            f.write("ok")
    return {name: os.path.join(root, name) for name in SOURCES}


def shared_sources(tmp_path_factory) -> dict[str, str]:
    """`build_sources` once per test run: under xdist the workers share the run's temp dir."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = os.path.join(str(shared), "hybridckpt-sources")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(str(shared), "hybridckpt-sources.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return build_sources(root)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
