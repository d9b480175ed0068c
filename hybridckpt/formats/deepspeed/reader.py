"""`open`: a DeepSpeed ZeRO checkpoint (stages 1, 2, 3, BF16_Optimizer) as lazy tensors and slots.

The model states (`*_model_states.pt`: `module`, `buffer_names`, `param_shapes` (one ordered
name -> shape dict per param group, IN FLAT ORDER), `frozen_param_shapes`,
`frozen_param_fragments`, `shared_params`, `global_steps`, `dp_world_size`, `mp_world_size`,
`ds_config`) name and shape the params; the optim states of every DP rank (`ranks`) hold them
partitioned (`partitions`). `partition_count` (int or per group) must equal the number of optim
files. Tensors are the fp32 master weights, named as the module names them; frozen params come
from their fragments (or, under stage 1, the 16-bit module weights), aliases from
`shared_params`. Without optimizer files (ZeRO disabled) the weights come from `module`.
MoE checkpoints (`layer_*_expert_*_model_states.pt`) read their expert optimizer groups per EP
rank and check them against the expert files (`experts`); the source's `hf_rules` are then
`rules/deepspeed_moe.rules` (DeepSpeed's MoE wrapper names -> HF's per-expert names).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hybridckpt import values
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats.deepspeed import experts
from hybridckpt.formats.deepspeed.files import (
    MODEL3_RE,
    MODEL_RE,
    OPTIM_RE,
    file_names,
    get_key,
    tag_dir,
)
from hybridckpt.formats.deepspeed.partitions import frozen_params, zero3, zero12
from hybridckpt.formats.deepspeed.ranks import check_ranks, read_rank
from hybridckpt.formats.rules_files import rules_text
from hybridckpt.io.config_file import config_beside
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim import torch_optim
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "deepspeed"
MOE_RULES = "deepspeed_moe.rules"
# the pipeline engine's per-layer files (runtime/pipe/module.py `ckpt_layer_path`:
# `layer_{idx:02d}[-{rank_repr}]-model_states.pt`, rank_repr e.g. `model_00`)
PIPE_RE = re.compile(r"^layer_\d+(-[A-Za-z]+_\d+)*-model_states\.pt$")


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = tag_dir(os.path.abspath(path))
    names = file_names(folder)
    optim: dict[int, str] = {}
    for n in names:
        m = OPTIM_RE.match(n)
        if m:
            if int(m.group(3)) != 0:
                raise FormatError(
                    f"{os.path.join(folder, n)}: model-parallel rank {int(m.group(3))}: DeepSpeed "
                    "checkpoints with tensor/pipeline parallelism (mp_rank > 0) are not supported"
                )
            optim[int(m.group(2))] = os.path.join(folder, n)
    if any(PIPE_RE.match(n) for n in names):
        raise FormatError(f"{folder}: pipeline-engine DeepSpeed checkpoints are not supported")
    expert_paths = experts.expert_files(names, folder)
    model3 = {int(m.group(1)): os.path.join(folder, n) for n in names if (m := MODEL3_RE.match(n))}
    model12 = [os.path.join(folder, n) for n in names if (m := MODEL_RE.match(n))]
    if any(MODEL_RE.match(n).group(1) != "00" for n in names if MODEL_RE.match(n)) or any(
        m.group(2) != "00" for n in names if (m := MODEL3_RE.match(n))
    ):
        raise FormatError(
            f"{folder}: mp_rank > 0 files: tensor/pipeline parallel DeepSpeed checkpoints are not supported"
        )
    dp = len(optim)
    if optim and sorted(optim) != list(range(dp)):
        raise FormatError(
            f"{folder}: optim files for dp ranks {sorted(optim)}, expected 0..{dp - 1}"
        )
    model_files = [model3[r] for r in sorted(model3)] if model3 else model12
    if not model_files:
        raise FormatError(f"{folder}: no '*_model_states.pt' file")
    models = _model_states(model_files)
    m0 = models[0]
    if not isinstance(m0, Mapping):
        raise FormatError(f"{model_files[0]}: expected a dict, found {type(m0).__name__}")
    mp = m0.get("mp_world_size", 1)
    if isinstance(mp, int) and mp > 1:
        raise FormatError(
            f"{model_files[0]}: mp_world_size {mp}: tensor-parallel DeepSpeed checkpoints are not supported"
        )
    notes: list[str] = []
    trainer = {
        k: m0[k]
        for k in ("global_steps", "global_samples", "skipped_steps", "ds_version", "dp_world_size")
        if k in m0
    }
    module = values.mapping(m0.get("module") or {}, model_files[0], "module")
    buffer_names = _names(m0.get("buffer_names") or [], model_files[0], "buffer_names")
    weights = experts.expert_weights(expert_paths) if expert_paths else {}
    moe_rules = rules_text(MOE_RULES) if expert_paths else ""
    if not optim:
        # ZeRO disabled: the module (and the expert files) hold the weights; no partitioned
        # optimizer to read
        tensors = {k: v for k, v in module.items() if isinstance(v, LazyTensor)} | weights
        notes.append("no ZeRO optimizer files: weights from 'module', no optimizer state")
        if any(experts.EXPP_OPTIM_RE.match(n) for n in names):
            notes.append(
                "expp_rank_*_optim_states.pt (torch optimizer state by parameter index, no ZeRO) "
                "not read: weights only"
            )
        return SourceCheckpoint(
            NAME,
            path,
            tensors,
            hf_rules=moe_rules,
            config=_config(path, folder, config),
            step=m0.get("global_steps"),
            trainer=trainer,
            notes=tuple(notes),
        )

    read = [read_rank(optim[r]) for r in range(dp)]
    stages = {zs for zs, _, _ in read}
    if len(stages) != 1:
        raise FormatError(
            f"{folder}: optim files disagree on zero_stage: {sorted(map(str, stages))}"
        )
    stage = stages.pop()
    ranks = [r for _, r, _ in read]
    check_ranks(ranks)
    moe = any(experts.is_moe_group(g) for g in ranks[0].groups)
    for _, r, pc in read if not moe else ():  # MoE: expert groups have their own counts
        counts = pc if isinstance(pc, list) else [pc]
        if any(not isinstance(c, int) or c != dp for c in counts):
            raise FormatError(
                f"{r.path}: partition_count {pc!r} but {dp} '*_optim_states.pt' files in {folder}"
            )
    shapes = get_key(m0, "param_shapes", model_files[0])
    if not isinstance(shapes, list) or not all(isinstance(g, Mapping) for g in shapes):
        raise FormatError(f"{model_files[0]}: param_shapes is not a list of dicts")
    if moe:
        if stage == 3:
            raise FormatError(f"{folder}: DeepSpeed MoE under ZeRO-3 is not supported")
        counts = _partition_counts(read, len(shapes))
        params, ep = experts.zero12_moe(
            ranks, counts, shapes, m0.get("ds_config"), stage is not None, model_files[0]
        )
        masters = {n: t["fp32"] for n, t in params.items()}
        experts.check_against_files(masters, weights, m0.get("num_experts"), folder)
        notes.append(experts.expert_count_note(m0.get("num_experts"), ep))
    elif stage == 3:
        if len(model_files) != dp:
            raise FormatError(
                f"{folder}: {len(model_files)} stage-3 model files for {dp} optim files"
            )
        params = zero3(ranks, shapes, model_files[0])
    else:
        params = zero12(
            ranks, shapes, ranks[0].align, stripped=stage is not None, model_file=model_files[0]
        )
    tensors = {n: t["fp32"] for n, t in params.items()}
    slots = {k: {n: t[k] for n, t in params.items()} for k in ranks[0].slots}
    frozen = frozen_params(models, 3 if stage == 3 else 2, model_files)
    tensors.update(frozen)
    if frozen:
        notes.append(f"frozen params (no optimizer state): {sorted(frozen)[:5]}")
    for b in buffer_names:
        t = module.get(b)
        if isinstance(t, LazyTensor):
            tensors[b] = t
    shared = values.mapping(m0.get("shared_params") or {}, model_files[0], "shared_params")
    _names([*shared, *shared.values()], model_files[0], "shared_params")  # alias -> a param's name
    # stage 1 saves no frozen_param_*: frozen params are only in the (16-bit) module weights
    from_module = [
        k
        for k, t in module.items()
        if k not in tensors and k not in shared and isinstance(t, LazyTensor) and t.size > 0
    ]
    for k in from_module:
        tensors[k] = module[k]
    frozen_experts = [k for k in weights if k not in tensors]  # no master: the file's weights
    tensors.update({k: weights[k] for k in frozen_experts})
    if frozen_experts:
        notes.append(
            f"expert params without fp32 masters, from their expert files: {frozen_experts[:5]}"
        )
    if from_module:
        notes.append(
            f"params without fp32 masters, taken from 'module' ({module[from_module[0]].dtype}): {from_module[:5]}"
        )
    for alias, src in shared.items():
        if src in tensors:
            tensors[alias] = tensors[src]
            for slot in slots.values():
                if src in slot:
                    slot[alias] = slot[src]
            notes.append(f"'{alias}' is tied to '{src}' (shared_params)")
    notes.append("tensors are the fp32 master weights from the optimizer partitions")
    kind = {None: "BF16_Optimizer", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}.get(
        stage, f"ZeRO-{stage}"
    )
    trainer["optimizer"] = kind
    group_names = [list(g) for g in shapes]
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        hf_rules=moe_rules,
        optimizer=OptimizerState(
            slots,
            None if ranks[0].step is None else int(ranks[0].step),
            hyper=torch_optim.hyper(ranks[0].groups, group_names, ranks[0].path),
        ),
        config=_config(path, folder, config),
        step=m0.get("global_steps"),
        topology={"dp": dp},
        trainer=trainer,
        notes=tuple(notes),
    )


def _names(value, where: str, key: str) -> list[str]:
    """`value` as a list of names (strings): `buffer_names`, `shared_params`' sources."""
    items = values.sequence(value, where, key)
    if not all(isinstance(n, str) for n in items):
        raise values.wrong(where, key, "a list of names", value)
    return items


def _model_states(files: list[str]) -> list:
    """Every rank's model states. Under ZeRO-3 every rank writes the same module placeholders,
    `param_shapes` and config (rank 0 alone adds `shared_params`); only the frozen params'
    fragments differ. So when rank 0 names no frozen param, a rank whose `data.pkl` equals one
    already parsed byte for byte is compared, not parsed again: parsing 512 copies of a
    1137-param module was most of the open time of a Llama 405B run on 512 ranks
    (docs/scale.md). Every other file is parsed as before."""
    m0 = torch_save.load(files[0])
    if len(files) == 1 or not isinstance(m0, Mapping) or m0.get("frozen_param_shapes"):
        return [m0] + [torch_save.load(f) for f in files[1:]]
    first = torch_save.zip_pickle(files[0])
    parsed = {} if first is None else {first: m0}
    out = [m0]
    for f in files[1:]:
        pkl = torch_save.zip_pickle(f)
        if pkl is not None and pkl in parsed:
            out.append(parsed[pkl])
            continue
        m = torch_save.load(f)
        if pkl is not None:
            parsed[pkl] = m
        out.append(m)
    return out


def _partition_counts(read, n_groups: int) -> list[int]:
    """`partition_count` per group, the same in every optim file."""
    counts = None
    for _, r, pc in read:
        c = pc if isinstance(pc, list) else [pc] * n_groups
        if len(c) != n_groups or not all(isinstance(x, int) for x in c):
            raise FormatError(f"{r.path}: partition_count {pc!r} for {n_groups} param groups")
        if counts is not None and c != counts:
            raise FormatError(f"{r.path}: partition_count {c}, but {read[0][1].path} has {counts}")
        counts = c
    return counts


def _config(path: str, folder: str, config):
    return config_beside(folder, os.path.abspath(path), os.path.dirname(folder), config=config)
