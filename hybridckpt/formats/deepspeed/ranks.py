"""One DP rank's `*_optim_states.pt`: its flat fp32 partitions and optimizer slots per group.

`optimizer_state_dict` (deepspeedai/DeepSpeed: runtime/zero/stage_1_and_2.py, runtime/zero/
stage3.py, runtime/bf16_optimizer.py `state_dict`):
- stage 1/2 (`zero_stage` 1 or 2): `single_partition_of_fp32_groups` (one flat fp32 piece per
  param group), `group_paddings`, `param_alignment_paddings`, and the torch state of the flat
  pieces in `base_optimizer_state` (an elastic checkpoint keeps one lean state per group).
- BF16_Optimizer (no `zero_stage`): the same keys.
- stage 3 (`zero_stage` 3): `fp32_flat_groups` (sub-groups) and the torch state in
  `optimizer_state_dict`.
The torch state of flat piece i is `state[param_groups[..]['params'][i]]`: its slots (every
tensor but `step`, under torch's names, see `torch_optim`) are laid out like the fp32 piece.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hybridckpt import values
from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.pickle.allow import Stub
from hybridckpt.errors import FormatError
from hybridckpt.formats.deepspeed.files import flat, get_key
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim import torch_optim

OSD = "optimizer_state_dict"


def _enum_value(x, what: str) -> int:
    """ZeroStageEnum pickles as `ZeroStageEnum(2)` (a stub here) or a plain int."""
    if isinstance(x, Stub) and x.stub_args and isinstance(x.stub_args[0], int):
        return int(x.stub_args[0])
    if isinstance(x, int):
        return int(x)
    raise FormatError(f"{what}: zero_stage is {x!r}")


@dataclass(frozen=True)
class Rank:
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
    state = get_key(osd_torch, "state", what)
    groups = values.sequence(get_key(osd_torch, "param_groups", what), what, "param_groups")
    order = [i for n, g in enumerate(groups)
             for i in torch_optim.group_params(values.mapping(g, what, f"param_groups[{n}]"), what, n)]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in order):
        raise values.wrong(what, "param_groups[..]['params']", "parameter indices", order)
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
            flat(t[name], f"{what} state[{idx}].{name}")
            for t, idx in zip(per_group.values(), order, strict=True)
        ]
        for name in names
    }
    if len(steps) > 1:
        raise FormatError(f"{what}: flat groups have different optimizer steps {sorted(steps)}")
    return slots, (steps.pop() if steps else None)


def read_rank(path: str) -> tuple[int | None, Rank, object]:
    """(zero_stage or None for BF16_Optimizer, the rank's partitions, partition_count)."""
    d = torch_save.load(path)
    osd = values.mapping(get_key(d, OSD, path), path, OSD)
    zs = _enum_value(osd["zero_stage"], path) if "zero_stage" in osd else None
    if zs == 3:
        groups = values.sequence(get_key(osd, "fp32_flat_groups", path), path, "fp32_flat_groups")
        torch_sd = get_key(osd, OSD, path)
        pads = [0] * len(groups)
    else:
        groups = values.sequence(get_key(osd, "single_partition_of_fp32_groups", path), path,
                                 "single_partition_of_fp32_groups")
        torch_sd = get_key(osd, "base_optimizer_state", path)
        pads = [values.integer(p, path, f"group_paddings[{i}]")
                for i, p in enumerate(values.sequence(get_key(osd, "group_paddings", path), path, "group_paddings"))]
        if isinstance(torch_sd, list):  # elastic checkpoint: a lean state per group
            torch_sd = {
                "state": dict(enumerate(torch_sd)),
                "param_groups": [{"params": [i]} for i in range(len(torch_sd))],
            }
    fp32 = [flat(t, f"{path} fp32 group {i}") for i, t in enumerate(groups)]
    if len(pads) != len(fp32):
        raise FormatError(f"{path}: {len(pads)} group_paddings for {len(fp32)} flat groups")
    slots, step = _slots(torch_sd, len(fp32), path)
    pg = [g for g in torch_sd.get("param_groups", []) if isinstance(g, Mapping)]
    align = osd.get("param_alignment_paddings")
    if align is not None:  # per group, per param: element counts
        align = [[values.integer(p, path, f"param_alignment_paddings[{g}][{i}]")
                  for i, p in enumerate(values.sequence(ps, path, f"param_alignment_paddings[{g}]"))]
                 for g, ps in enumerate(values.sequence(align, path, "param_alignment_paddings"))]
    return zs, Rank(path, fp32, slots, pads, step, pg, align), osd.get("partition_count")


def check_ranks(ranks: list[Rank]) -> None:
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
