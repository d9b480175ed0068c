"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3 and the BF16_Optimizer), read without DeepSpeed.

Layout (deepspeedai/DeepSpeed: deepspeed/runtime/engine.py `save_checkpoint`, `_get_ckpt_name`,
`_get_zero_ckpt_name`; runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py,
runtime/bf16_optimizer.py `state_dict`; utils/zero_to_fp32.py rebuilds the same way):
- `<save>/latest` holds the tag; `<save>/<tag>/` (default `global_step{N}`) holds
  `mp_rank_00_model_states.pt` (stage <= 2) or `zero_pp_rank_{dp}_mp_rank_00_model_states.pt`
  (stage 3, one per DP rank), and `[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt`.
- model states: `module` (16-bit weights; empty placeholders under stage 3), `buffer_names`,
  `param_shapes` (one ordered name -> shape dict per param group, IN FLAT ORDER),
  `frozen_param_shapes`, `frozen_param_fragments` (whole tensors for stage <= 2, the rank's
  `ceil(numel/dp)` partition for stage 3), `shared_params` {alias: source} (rank 0's file),
  `global_steps`, `dp_world_size`, `mp_world_size`, `ds_config`.
- optim states `optimizer_state_dict`:
  - stage 1/2 (`zero_stage` 1 or 2): per group, rank r holds partition r of the group's flat
    fp32 vector `single_partition_of_fp32_groups[g]`: params back to back in `param_shapes`
    order, each followed by `param_alignment_paddings[g][i]` elements (absent = 0), the tail
    padded to a multiple of 2*dp and split in dp equal partitions; the padding is stripped on
    save, so the last rank's partition is shorter by `group_paddings[g]`. The optimizer slots
    are the torch state of the flat partition, `base_optimizer_state['state'][idx][<slot>]`
    (`idx` = `param_groups[g]['params'][0]`; Adam's `exp_avg`, `exp_avg_sq`, any optimizer's own
    names, see `torch_optim`), laid out like the fp32 partition (padding kept).
  - BF16_Optimizer (no `zero_stage`): the same, but the partitions are NOT stripped: the last
    rank's `group_paddings[g]` tail elements are padding.
  - stage 3 (`zero_stage` 3): every param is split on its own: `pn = ceil(numel/dp)`, rank r
    holds elements `[r*pn, (r+1)*pn)` of the flattened param (zero-padded; the padding holds
    garbage and is never read). A rank's `fp32_flat_groups` (sub-groups) joined end to end hold
    its partitions of the params of the merged `param_shapes`, back to back. The slots are
    `optimizer_state_dict['state'][i]` of sub-group i, laid out like `fp32_flat_groups[i]`.
- `partition_count` (int or per group) must equal the number of optim files.

Tensors are the fp32 master weights (what the optimizer steps), named as the module names them
(HF names for HF models: `hf_rules` is empty); frozen params come from their fragments, aliases
from `shared_params`. Only `mp_rank_00` (no tensor/pipeline parallelism) is supported.
"""

from __future__ import annotations

import builtins
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hybridckpt import lazy
from hybridckpt.errors import FormatError
from hybridckpt.formats import torch_optim
from hybridckpt.io.pickle import torch_save
from hybridckpt.io.pickle.allow import Stub
from hybridckpt.lazy import LazyTensor
from hybridckpt.source import OptimizerState, SourceCheckpoint

NAME = "deepspeed"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_OSD = "optimizer_state_dict"


# -- discovery ---------------------------------------------------------------------------------


def _names(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _is_tag_dir(folder: str) -> bool:
    return any(_OPTIM.match(n) or _MODEL.match(n) or _MODEL3.match(n) for n in _names(folder))


def tag_dir(path: str) -> str:
    """The folder holding the rank files: `path` itself, `path/<latest tag>`, or its one tag."""
    if _is_tag_dir(path):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with builtins.open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
        folder = os.path.join(path, tag)
        if not tag or not _is_tag_dir(folder):
            raise FormatError(
                f"{latest}: names tag {tag!r}, but {folder} holds no DeepSpeed rank files"
            )
        return folder
    tags = [n for n in _names(path) if _is_tag_dir(os.path.join(path, n))]
    if len(tags) == 1:
        return os.path.join(path, tags[0])
    if tags:
        raise FormatError(
            f"{path}: no 'latest' file and several tags {tags[:5]}: pass one tag folder"
        )
    raise FormatError(f"{path}: no DeepSpeed '*_model_states.pt' / '*_optim_states.pt' files")


def detect(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if _is_tag_dir(path):
        return True
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest) and os.path.getsize(latest) < 4096:
        try:
            tag_dir(path)
            return True
        except (FormatError, UnicodeDecodeError):
            return False
    return False


# -- small readers -----------------------------------------------------------------------------


def _get(d, key: str, what: str):
    if not isinstance(d, Mapping) or key not in d:
        raise FormatError(f"{what}: no '{key}'")
    return d[key]


def _enum_value(x, what: str) -> int:
    """ZeroStageEnum pickles as `ZeroStageEnum(2)` (a stub here) or a plain int."""
    if isinstance(x, Stub) and x.stub_args and isinstance(x.stub_args[0], int):
        return int(x.stub_args[0])
    if isinstance(x, int):
        return int(x)
    raise FormatError(f"{what}: zero_stage is {x!r}")


def _flat(t, what: str) -> LazyTensor:
    if not isinstance(t, LazyTensor):
        raise FormatError(f"{what}: expected a tensor, found {type(t).__name__}")
    return t if t.ndim == 1 else lazy.reshape(t, (t.size,))


def _shape(s, what: str) -> tuple[int, ...]:
    if not isinstance(s, (tuple, list)) or not all(isinstance(i, int) and i >= 0 for i in s):
        raise FormatError(f"{what}: bad shape {s!r}")
    return tuple(int(i) for i in s)


def _cut(flat: LazyTensor, start: int, numel: int, shape: tuple[int, ...]) -> LazyTensor:
    return lazy.reshape(lazy.slice_axis(flat, 0, start, start + numel), shape)


@dataclass(frozen=True)
class _Rank:
    """One DP rank's optim file: the fp32 flat pieces and optimizer slots per group (or sub-group)."""

    path: str
    fp32: list[LazyTensor]
    slots: dict[str, list[LazyTensor]]  # slot name ("exp_avg", ...) -> one flat piece per group
    paddings: list[int]
    step: float | None
    groups: list[dict]
    align: list | None  # param_alignment_paddings (stage 1/2), per group per param

    def flats(self) -> dict[str, list[LazyTensor]]:
        """"fp32" and every slot: the flat pieces laid out alike, per group."""
        return {"fp32": self.fp32, **self.slots}


def _slots(osd_torch, n: int, what: str) -> tuple[dict[str, list], float | None]:
    """The torch optimizer state of its params 0..n-1 (one flat tensor each), by slot name."""
    state = _get(osd_torch, "state", what)
    groups = _get(osd_torch, "param_groups", what)
    order = [i for g in groups for i in g.get("params", [])]
    if len(order) != n:
        raise FormatError(
            f"{what}: the torch optimizer has {len(order)} params, expected {n} flat groups"
        )
    per_group, steps = {}, set()
    for k, idx in enumerate(order):
        s = state.get(idx) if isinstance(state, Mapping) else None
        if not isinstance(s, Mapping):
            raise FormatError(f"{what}: no optimizer state for flat group {k} (state {idx})")
        tensors, step = torch_optim.param_state(s, f"{what} state[{idx}]")
        per_group[f"flat group {k} (state {idx})"] = tensors
        if step is not None:
            steps.add(step)
    names = torch_optim.check_same_slots(per_group, what)
    slots = {
        name: [
            _flat(t[name], f"{what} state[{idx}].{name}")
            for t, idx in zip(per_group.values(), order, strict=True)
        ]
        for name in names
    }
    if len(steps) > 1:
        raise FormatError(f"{what}: flat groups have different optimizer steps {sorted(steps)}")
    return slots, (steps.pop() if steps else None)


def _read_rank(path: str) -> tuple[int | None, _Rank, object]:
    """(zero_stage or None for BF16_Optimizer, the rank's partitions, partition_count)."""
    d = torch_save.load(path)
    osd = _get(d, _OSD, path)
    zs = _enum_value(osd["zero_stage"], path) if "zero_stage" in osd else None
    if zs == 3:
        groups = _get(osd, "fp32_flat_groups", path)
        torch_sd = _get(osd, _OSD, path)
        pads = [0] * len(groups)
    else:
        groups = _get(osd, "single_partition_of_fp32_groups", path)
        torch_sd = _get(osd, "base_optimizer_state", path)
        pads = list(_get(osd, "group_paddings", path))
        if isinstance(torch_sd, list):  # elastic checkpoint: a lean state per group
            torch_sd = {
                "state": dict(enumerate(torch_sd)),
                "param_groups": [{"params": [i]} for i in range(len(torch_sd))],
            }
    fp32 = [_flat(t, f"{path} fp32 group {i}") for i, t in enumerate(groups)]
    if len(pads) != len(fp32):
        raise FormatError(f"{path}: {len(pads)} group_paddings for {len(fp32)} flat groups")
    slots, step = _slots(torch_sd, len(fp32), path)
    pg = [g for g in torch_sd.get("param_groups", []) if isinstance(g, Mapping)]
    align = osd.get("param_alignment_paddings")
    return zs, _Rank(path, fp32, slots, pads, step, pg, align), osd.get("partition_count")


def _check_ranks(ranks: list[_Rank]) -> None:
    """Every rank holds rank 0's slots, and the flat pieces of one kind (fp32, each slot) share
    rank 0's dtype: they are joined end to end."""
    for r in ranks[1:]:
        if sorted(r.slots) != sorted(ranks[0].slots):
            raise FormatError(
                f"{r.path}: optimizer state {sorted(r.slots)}, but {ranks[0].path} holds "
                f"{sorted(ranks[0].slots)}"
            )
    for kind, ref in ranks[0].flats().items():
        if not ref:
            continue
        want = ref[0].dtype
        for r in ranks:
            for g, t in enumerate(r.flats()[kind]):
                if t.dtype != want:
                    raise FormatError(
                        f"{r.path}: {kind} of flat group {g} is {t.dtype}, expected {want} as in "
                        f"{ranks[0].path}"
                    )


# -- stage 1/2 and BF16_Optimizer ----------------------------------------------------------------


def _zero12(ranks: list[_Rank], shapes: list[dict], align_pads, stripped: bool, model_file: str):
    """name -> {"fp32": master, slot: tensor, ...} of every trainable param."""
    out = {}
    if any(len(r.fp32) != len(shapes) for r in ranks):
        raise FormatError(
            f"{ranks[0].path}: {len(ranks[0].fp32)} flat groups, but {model_file} has "
            f"param_shapes for {len(shapes)} groups"
        )
    for g, group in enumerate(shapes):
        parts: dict[str, list] = {k: [] for k in ranks[0].flats()}
        for r in ranks:
            n = r.fp32[g].size - (0 if stripped else r.paddings[g])
            if n < 0:
                raise FormatError(
                    f"{r.path}: group {g} padding {r.paddings[g]} exceeds its partition"
                )
            for key, pieces in r.flats().items():
                t = pieces[g]
                if t.size < n:
                    raise FormatError(
                        f"{r.path}: group {g} {key} has {t.size} elements, the fp32 partition {n}"
                    )
                parts[key].append(lazy.slice_axis(t, 0, 0, n))
        flats = {k: lazy.concat(v, 0) for k, v in parts.items()}
        pads = list(align_pads[g]) if align_pads is not None else [0] * len(group)
        if len(pads) != len(group):
            raise FormatError(
                f"{ranks[0].path}: param_alignment_paddings[{g}] has {len(pads)} entries for "
                f"{len(group)} params"
            )
        pos = 0
        for (name, shape), pad in zip(group.items(), pads, strict=True):
            shape = _shape(shape, f"{model_file}: param_shapes '{name}'")
            numel = math.prod(shape)
            if pos + numel > flats["fp32"].size:
                break
            out[name] = {k: _cut(f, pos, numel, shape) for k, f in flats.items()}
            pos += numel + int(pad)
        total = flats["fp32"].size
        needed = sum(math.prod(_shape(s, model_file)) for s in group.values()) + sum(
            int(p) for p in pads
        )
        if needed != total:
            raise FormatError(
                f"{model_file}: param_shapes group {g} needs {needed} elements (params + alignment "
                f"padding) but the {len(ranks)} partitions of 'single_partition_of_fp32_groups' "
                f"hold {total} after padding: numel totals do not add up"
            )
    return out


# -- stage 3 ------------------------------------------------------------------------------------


def _zero3(ranks: list[_Rank], shapes: list[dict], model_file: str):
    """name -> {"fp32": master, slot: tensor, ...} of every trainable param."""
    dp = len(ranks)
    merged = [
        (n, _shape(s, f"{model_file}: param_shapes '{n}'"))
        for grp in shapes
        for n, s in grp.items()
    ]
    per_rank = sum(math.ceil(math.prod(s) / dp) for _, s in merged)
    flats = []
    for r in ranks:
        f = {k: lazy.concat(v, 0) for k, v in r.flats().items()}
        for k, pieces in r.slots.items():
            if [t.size for t in pieces] != [t.size for t in r.fp32]:
                raise FormatError(f"{r.path}: {k} sub-group sizes differ from fp32_flat_groups")
        if f["fp32"].size != per_rank:
            raise FormatError(
                f"{r.path}: 'fp32_flat_groups' hold {f['fp32'].size} elements, but {model_file} "
                f"param_shapes need {per_rank} per rank (sum of ceil(numel/{dp})): numel totals do "
                f"not add up"
            )
        flats.append(f)
    out = {}
    off = 0
    for name, shape in merged:
        numel = math.prod(shape)
        pn = math.ceil(numel / dp)
        out[name] = {
            k: _cut(
                lazy.concat([lazy.slice_axis(f[k], 0, off, off + pn) for f in flats], 0),
                0,
                numel,
                shape,
            )
            for k in flats[0]
        }
        off += pn
    return out


def _frozen(models: list[dict], stage: int, model_files: list[str]) -> dict[str, LazyTensor]:
    shapes = models[0].get("frozen_param_shapes") or {}
    out = {}
    dp = len(models)
    for name, s in shapes.items():
        shape = _shape(s, f"{model_files[0]}: frozen_param_shapes '{name}'")
        numel = math.prod(shape)
        if stage == 3:
            frags = []
            for m, f in zip(models, model_files, strict=True):
                t = (m.get("frozen_param_fragments") or {}).get(name)
                if not isinstance(t, LazyTensor):
                    raise FormatError(f"{f}: no frozen_param_fragments '{name}'")
                if t.size != math.ceil(numel / dp):
                    raise FormatError(
                        f"{f}: frozen_param_fragments '{name}' has {t.size} elements, expected {math.ceil(numel / dp)}"
                    )
                frags.append(_flat(t, f))
            out[name] = _cut(lazy.concat(frags, 0), 0, numel, shape)
        else:
            t = (models[0].get("frozen_param_fragments") or {}).get(name)
            if not isinstance(t, LazyTensor) or t.size != numel:
                raise FormatError(
                    f"{model_files[0]}: frozen_param_fragments '{name}' is not a {shape} tensor"
                )
            out[name] = lazy.reshape(t, shape)
    return out


# -- open ---------------------------------------------------------------------------------------


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = tag_dir(os.path.abspath(path))
    names = _names(folder)
    optim: dict[int, str] = {}
    for n in names:
        m = _OPTIM.match(n)
        if m:
            if int(m.group(3)) != 0:
                raise FormatError(
                    f"{os.path.join(folder, n)}: model-parallel rank {int(m.group(3))}: DeepSpeed "
                    "checkpoints with tensor/pipeline parallelism (mp_rank > 0) are not supported"
                )
            optim[int(m.group(2))] = os.path.join(folder, n)
    if any(n.startswith("layer_") or n.startswith("expp_rank_") for n in names):
        raise FormatError(
            f"{folder}: pipeline-engine or MoE DeepSpeed checkpoints are not supported"
        )
    model3 = {int(m.group(1)): os.path.join(folder, n) for n in names if (m := _MODEL3.match(n))}
    model12 = [os.path.join(folder, n) for n in names if (m := _MODEL.match(n))]
    if any(_MODEL.match(n).group(1) != "00" for n in names if _MODEL.match(n)) or any(
        m.group(2) != "00" for n in names if (m := _MODEL3.match(n))
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
    models = [torch_save.load(f) for f in model_files]
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
    module = m0.get("module") or {}
    buffer_names = list(m0.get("buffer_names") or [])
    if not optim:
        # ZeRO disabled: the module holds the weights; no partitioned optimizer to read
        tensors = {k: v for k, v in module.items() if isinstance(v, LazyTensor)}
        notes.append("no ZeRO optimizer files: weights from 'module', no optimizer state")
        return SourceCheckpoint(
            NAME,
            path,
            tensors,
            config=_config(path, folder, config),
            step=m0.get("global_steps"),
            trainer=trainer,
            notes=tuple(notes),
        )

    read = [_read_rank(optim[r]) for r in range(dp)]
    stages = {zs for zs, _, _ in read}
    if len(stages) != 1:
        raise FormatError(
            f"{folder}: optim files disagree on zero_stage: {sorted(map(str, stages))}"
        )
    stage = stages.pop()
    ranks = [r for _, r, _ in read]
    _check_ranks(ranks)
    for _, r, pc in read:
        counts = pc if isinstance(pc, list) else [pc]
        if any(not isinstance(c, int) or c != dp for c in counts):
            raise FormatError(
                f"{r.path}: partition_count {pc!r} but {dp} '*_optim_states.pt' files in {folder}"
            )
    shapes = _get(m0, "param_shapes", model_files[0])
    if not isinstance(shapes, list) or not all(isinstance(g, Mapping) for g in shapes):
        raise FormatError(f"{model_files[0]}: param_shapes is not a list of dicts")
    if stage == 3:
        if len(model_files) != dp:
            raise FormatError(
                f"{folder}: {len(model_files)} stage-3 model files for {dp} optim files"
            )
        params = _zero3(ranks, shapes, model_files[0])
    else:
        params = _zero12(
            ranks, shapes, ranks[0].align, stripped=stage is not None, model_file=model_files[0]
        )
    tensors = {n: t["fp32"] for n, t in params.items()}
    slots = {k: {n: t[k] for n, t in params.items()} for k in ranks[0].slots}
    frozen = _frozen(models, 3 if stage == 3 else 2, model_files)
    tensors.update(frozen)
    if frozen:
        notes.append(f"frozen params (no optimizer state): {sorted(frozen)[:5]}")
    for b in buffer_names:
        t = module.get(b)
        if isinstance(t, LazyTensor):
            tensors[b] = t
    shared = m0.get("shared_params") or {}
    # stage 1 saves no frozen_param_*: frozen params are only in the (16-bit) module weights
    from_module = [
        k
        for k, t in module.items()
        if k not in tensors and k not in shared and isinstance(t, LazyTensor) and t.size > 0
    ]
    for k in from_module:
        tensors[k] = module[k]
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
        optimizer=OptimizerState(
            slots,
            None if ranks[0].step is None else int(ranks[0].step),
            hyper=torch_optim.hyper(ranks[0].groups, group_names),
        ),
        config=_config(path, folder, config),
        step=m0.get("global_steps"),
        topology={"dp": dp},
        trainer=trainer,
        notes=tuple(notes),
    )


def _config(path: str, folder: str, config):
    from hybridckpt.formats.config_file import config_beside

    return config_beside(folder, os.path.abspath(path), os.path.dirname(folder), config=config)
