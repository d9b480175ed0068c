"""`open`: a DCP folder as lazy global tensors, optimizer slots and trainer metadata.

The `.metadata` layouts give the model tensors (after the model prefix), the optimizer's slots
and step and its param groups (`structure`); the safetensors-shards layout gives tensors only.
Names after the model prefix are the model's own: HF names for HF models (`hf_rules` empty), or
torchtitan's names (`tok_embeddings`, `layers.N.attention.qkv_linear.wq`, ...) mapped by the
family's torchtitan dialect (`models/<family>/dialects/torchtitan.rules`), the moments of its
fused q/k/v parameter split like the weights first (`torchtitan`). A torchtitan CheckpointManager folder (`step-N/`
subfolders) reads its latest step (`steps`: `--step` picks another); a `step-N` folder's config.json may sit in its parent.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

from hybridckpt.containers.dcp_metadata import metadata_files, read_metadata
from hybridckpt.errors import FormatError
from hybridckpt.formats.dcp import torchtitan
from hybridckpt.formats.dcp.storage import (
    check_files,
    entry_tensor,
    hf_shards,
    read_hf_shards,
    safetensors_blobs,
)
from hybridckpt.formats.dcp.storage import detect as storage_detect
from hybridckpt.formats.dcp.structure import find_structure, param_groups
from hybridckpt.io.config_file import config_beside
from hybridckpt.io.gc_pause import gc_paused
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim import torch_optim
from hybridckpt.optim.torch_optim import STEP, check_complete
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "dcp"


def _config(folder: str, config):
    """The given config, else a config.json in the folder (or, for a torchtitan `step-N`
    folder, in the CheckpointManager folder above it)."""
    folders = [folder]
    if re.match(r"^step-\d+$", os.path.basename(folder)):
        folders.append(os.path.dirname(folder))
    return config_beside(*folders, config=config)


def detect(path: str) -> bool:
    """A DCP folder, or a torchtitan CheckpointManager folder holding `step-N` DCP folders."""
    return storage_detect(path) or torchtitan.steps(path) is not None


steps = torchtitan.steps  # a CheckpointManager folder's `step-N` folders (`io.step_folders`)


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        raise FormatError(f"{path}: a DCP checkpoint is a folder")
    found = torchtitan.steps(folder)
    if found is not None:
        src = _open_metadata(path, found.folder(found.default), config)
        return replace(src, notes=(f"torchtitan checkpoint folder: {found.note(found.default)}", *src.notes))
    if not metadata_files(folder):
        return _open_hf_shards(path, folder, config)
    return _open_metadata(path, folder, config)


def _open_hf_shards(path: str, folder: str, config) -> SourceCheckpoint:
    """The safetensors variant: tensors only, from the shards' sharding info."""
    shards = hf_shards(folder)
    if not shards:
        raise FormatError(f"{path}: no .metadata, __<rank>.metadata or shard-*.safetensors")
    tensors = read_hf_shards(folder, shards)
    dialect = torchtitan.dialect(tensors)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        hf_rules=dialect.rules_text() if dialect else "",
        rule_vars=dict(dialect.rule_vars) if dialect else {},
        config=_config(folder, config),
        topology={"files": len(shards)},
        notes=("DCP safetensors shards (HuggingFaceStorageWriter, save_distributed)",),
    )


@gc_paused()  # 10^5-10^6 objects (tables, expert views), no cycles: `io.gc_pause`
def _open_metadata(path: str, folder: str, config) -> SourceCheckpoint:
    """The `.metadata` layouts: model tensors, optimizer slots, step and param groups."""
    notes: list[str] = []
    md = read_metadata(folder)
    check_files(md)
    st = find_structure(md.tensors, md.planner_data)
    blobs = safetensors_blobs(md)
    all_t = {k: entry_tensor(e, blobs) for k, e in md.tensors.items()}
    tensors: dict[str, LazyTensor] = {}
    slots: dict[str, dict[str, LazyTensor]] = {}
    steps: dict[str, float] = {}
    skipped: list[str] = []
    state = None if st.optim is None else st.optim + "state."
    groups_prefix = None if st.optim is None else st.optim + "param_groups."
    for k, t in all_t.items():
        if state is not None and k.startswith(state):
            body = k[len(state) :]
            name, _, slot = body.rpartition(".")
            if not name:
                skipped.append(k)
            elif slot == STEP:
                if t.shape == ():
                    steps[name] = float(t.materialize())
                else:
                    skipped.append(k)
            else:
                slots.setdefault(slot, {})[name] = t
        elif groups_prefix is not None and k.startswith(groups_prefix):
            continue
        elif not st.model and torchtitan.is_trainer_state(k):
            skipped.append(k)  # torchtitan's lr_scheduler / train_state / dataloader
        elif k.startswith(st.model):
            tensors[k[len(st.model) :]] = t
        else:
            skipped.append(k)
    if skipped:
        notes.append(
            f"skipped {len(skipped)} tensors outside the model and optimizer state: "
            f"{sorted(skipped)[:5]}"
        )
    cfg = _config(folder, config)
    dialect = torchtitan.dialect(tensors)
    if dialect is not None:
        tensors, slots, titan_notes = _split_fused(tensors, slots, cfg)
        notes += titan_notes
        tensors, slots, moe_notes = torchtitan.moe_tensors(tensors, slots, cfg, md.files[0])
        notes += moe_notes
    optimizer = None
    step = None
    if slots:
        check_complete(slots, md.files[0])
        orphans = sorted(set(next(iter(slots.values()))) - set(tensors))
        if orphans:
            notes.append(f"optimizer state without a model tensor: {orphans[:5]}")
        if steps:
            values = set(steps.values())
            step = int(max(values))
            if len(values) > 1:
                notes.append(
                    f"params have different optimizer steps {sorted(values)[:5]}; using {step}"
                )
        groups = param_groups(md, st.optim)
        names = [
            [p for p in torch_optim.group_params(g, md.files[0], i) if isinstance(p, str)]  # fqns, as the state's
            for i, g in enumerate(groups)
        ]
        optimizer = OptimizerState(slots, step, hyper=torch_optim.hyper(groups, names, md.files[0]),
                                   groups=torch_optim.group_table(groups, names, md.files[0]))
    if not tensors:
        raise FormatError(f"{md.files[0]}: no model tensors found (keys: {sorted(md.tensors)[:5]})")
    if dialect is not None:
        notes.append(dialect.note())
    trainer_state = torchtitan.trainer_state(md) if not st.model else {}
    if step is None:
        step = trainer_state.get("train_state.step")
    if len(md.files) > 1:
        notes.append(f"rank-local metadata: {len(md.files)} __<rank>.metadata files merged")
    writers = {
        m.group(1)
        for i in md.table.used_files()
        if (m := re.match(r"__(\d+)_\d+\.distcp$", os.path.basename(md.table.files[i])))
    }
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=dialect.rules_text() if dialect else "",
        rule_vars=dict(dialect.rule_vars) if dialect else {},
        config=cfg,
        step=step,
        topology={"writers": len(writers)} if writers else {},
        trainer={
            "dcp_version": md.version,
            "written_to": md.written_to,
            "model_prefix": st.model,
            "optimizer_prefix": st.optim,
            **trainer_state,
        },
        notes=tuple(notes),
    )


def _split_fused(tensors: dict, slots: dict, cfg) -> tuple[dict, dict, list[str]]:
    """torchtitan's fused `qkv_linear.wqkv` (the moments; a model tensor in some releases)
    split into the wq/wk/wv names of the model tensors (`torchtitan.split_fused_qkv`); without
    a config the head counts are unknown and they stay fused (noted)."""
    fused = torchtitan.has_fused(tensors) or any(torchtitan.has_fused(v) for v in slots.values())
    if not fused:
        return tensors, slots, []
    if cfg is None:
        return tensors, slots, [
            "torchtitan's fused q/k/v (`qkv_linear.wqkv`) stays fused: splitting it into wq/wk/wv "
            "like the model tensors needs the head counts (pass --config)"
        ]
    from hybridckpt import models

    v = models.rule_variables(cfg)
    heads, kv = v["num_heads"], v["num_kv_heads"]
    tensors = torchtitan.split_fused_qkv(tensors, heads, kv)
    slots = {s: torchtitan.split_fused_qkv(t, heads, kv) for s, t in slots.items()}
    return tensors, slots, [
        f"torchtitan's fused q/k/v (`qkv_linear.wqkv`, moments keyed by the fused parameter) split "
        f"into wq/wk/wv per kv group ({heads} heads, {kv} kv heads)"
    ]
