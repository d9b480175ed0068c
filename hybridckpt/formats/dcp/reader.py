"""`open`: a DCP folder as lazy global tensors, optimizer slots and trainer metadata.

The `.metadata` layouts give the model tensors (after the model prefix), the optimizer's slots
and step and its param groups (`structure`); the safetensors-shards layout gives tensors only.
Names after the model prefix are the model's own: HF names for HF models (`hf_rules` empty), or
torchtitan Llama names (`tok_embeddings`, `layers.N.attention.wq`, ...) mapped by
`rules/torchtitan_llama.rules`.
"""

from __future__ import annotations

import os
import re

from hybridckpt.errors import FormatError
from hybridckpt.formats import torch_optim
from hybridckpt.formats.config_file import config_beside
from hybridckpt.formats.dcp.storage import (
    check_files,
    entry_tensor,
    hf_shards,
    read_hf_shards,
    safetensors_blobs,
)
from hybridckpt.formats.dcp.structure import find_structure, param_groups
from hybridckpt.formats.rules_files import rules_text
from hybridckpt.formats.torch_optim import STEP, check_complete
from hybridckpt.io.dcp_metadata import metadata_files, read_metadata
from hybridckpt.lazy import LazyTensor
from hybridckpt.source import OptimizerState, SourceCheckpoint

NAME = "dcp"


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def _is_torchtitan(names) -> bool:
    return any(n.startswith("tok_embeddings.") for n in names) or any(
        ".attention.wq." in n for n in names
    )


def _config(folder: str, config):
    return config_beside(folder, config=config)


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        raise FormatError(f"{path}: a DCP checkpoint is a folder")
    if not metadata_files(folder):
        return _open_hf_shards(path, folder, config)
    return _open_metadata(path, folder, config)


def _open_hf_shards(path: str, folder: str, config) -> SourceCheckpoint:
    """The safetensors variant: tensors only, from the shards' sharding info."""
    shards = hf_shards(folder)
    if not shards:
        raise FormatError(f"{path}: no .metadata, __<rank>.metadata or shard-*.safetensors")
    tensors = read_hf_shards(folder, shards)
    names = list(tensors)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        hf_rules=rules_text("torchtitan_llama.rules") if _is_torchtitan(names) else "",
        config=_config(folder, config),
        topology={"files": len(shards)},
        notes=("DCP safetensors shards (HuggingFaceStorageWriter, save_distributed)",),
    )


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
        elif k.startswith(st.model):
            tensors[k[len(st.model) :]] = t
        else:
            skipped.append(k)
    if skipped:
        notes.append(
            f"skipped {len(skipped)} tensors outside the model and optimizer state: "
            f"{sorted(skipped)[:5]}"
        )
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
        hyper = torch_optim.hyper(
            groups,
            [
                [_strip(p, st.model) for p in g.get("params", []) if isinstance(p, str)]
                for g in groups
            ],
        )
        optimizer = OptimizerState(slots, step, hyper=hyper)
    if not tensors:
        raise FormatError(f"{md.files[0]}: no model tensors found (keys: {sorted(md.tensors)[:5]})")
    hf_rules = ""
    if _is_torchtitan(tensors):
        hf_rules = rules_text("torchtitan_llama.rules")
        notes.append("torchtitan Llama names: rules/torchtitan_llama.rules (wq/wk RoPE permuted)")
    if len(md.files) > 1:
        notes.append(f"rank-local metadata: {len(md.files)} __<rank>.metadata files merged")
    writers = {
        m.group(1)
        for e in md.tensors.values()
        for c in e.chunks
        if (m := re.match(r"__(\d+)_\d+\.distcp$", os.path.basename(c.path)))
    }
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=hf_rules,
        config=_config(folder, config),
        step=step,
        topology={"writers": len(writers)} if writers else {},
        trainer={
            "dcp_version": md.version,
            "written_to": md.written_to,
            "model_prefix": st.model,
            "optimizer_prefix": st.optim,
        },
        notes=tuple(notes),
    )
