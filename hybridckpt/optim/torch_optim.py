"""torch optimizer state dicts as slots: what a reader finds per parameter, by the framework's name.

torch's `Optimizer.state_dict()` (pytorch/pytorch: torch/optim/optimizer.py `state_dict`) is
`{"state": {i: {"step": 0-d tensor or float, <slot>: tensor, ...}}, "param_groups": [{"params":
[i, ...], "lr", "betas", "eps", "weight_decay", ...}]}`. The per-parameter tensors are named by
the optimizer: Adam(W) `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad), SGD
`momentum_buffer`, ... A reader keeps every one of them as a slot under its own name (never a
fixed list), so which optimizer a checkpoint holds is decided once, from the slot names
(`hybridckpt.optim.for_slots`). DCP's flattened form (`<opt>state.<fqn>.<slot>`) and the flat
per-group partitions of DeepSpeed and Megatron carry the same names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hybridckpt import values
from hybridckpt.errors import FormatError, HybridCkptError
from hybridckpt.lazy import LazyTensor

STEP = "step"  # torch's step counter in `state[i]` (optax's `count`)


def param_state(entry: Mapping, where: str) -> tuple[dict[str, LazyTensor], float | None]:
    """One `state[i]` entry: its tensors by slot name (all but `step`) and its step (or None)."""
    if not isinstance(entry, Mapping):
        raise FormatError(f"{where}: expected a dict of optimizer state, found {type(entry).__name__}")
    slots: dict[str, LazyTensor] = {}
    step = None
    for key, value in entry.items():
        if key == STEP:
            step = values.number(value, where, STEP)
        elif isinstance(key, str) and isinstance(value, LazyTensor):
            slots[key] = value
    return slots, step


def check_same_slots(found: Mapping[Any, Iterable[str]], where: str) -> tuple[str, ...]:
    """The slot names every entry of `found` (label -> its slot names) holds; a FormatError naming
    the first entry that differs from the first one, or when the first holds none."""
    items = list(found.items())
    if not items:
        return ()
    first_label, first = items[0][0], sorted(items[0][1])
    if not first:
        raise FormatError(f"{where}: no per-parameter optimizer state for {first_label}")
    for label, names in items[1:]:
        if sorted(names) != first:
            raise FormatError(
                f"{where}: optimizer state of {label} holds {sorted(names)}, but {first_label} "
                f"holds {first}"
            )
    return tuple(first)


def check_complete(slots: Mapping[str, Mapping[str, Any]], where: str) -> None:
    """Every parameter with optimizer state has every slot (a FormatError naming those that do not)."""
    names = set().union(*(set(v) for v in slots.values())) if slots else set()
    partial = sorted(n for n in names if any(n not in v for v in slots.values()))
    if partial:
        have = {s: partial[0] in v for s, v in slots.items()}
        raise FormatError(
            f"{where}: not every slot of the optimizer state {sorted(slots)} is there for "
            f"{partial[:5]} (for {partial[0]!r}: {have})"
        )


def slot_shape(slot_names: Sequence[str], slot: str, param_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape `slot` must have for a parameter of `param_shape`: from the slot's declared
    relation when `slot_names` are a known optimizer's, else the parameter's own shape."""
    from hybridckpt import optim

    try:
        return optim.for_slots(slot_names).slot(slot).relation.shape(param_shape)
    except (HybridCkptError, KeyError):
        return tuple(param_shape)


def group_table(groups: Sequence[Mapping], names: Sequence[Sequence[str]],
                where: str = "param_groups") -> tuple[dict, ...]:
    """Every param group as the source records it, alike or not: its hyper-parameters (checked
    as `hyper` checks them) and `params`, how many params it names (`OptimizerState.groups`, what
    `inspect` shows)."""
    from hybridckpt.optim.groups import check_group

    return tuple({**check_group(values.mapping(g, where, f"param_groups[{i}]"), where, f"param_groups[{i}][{{!r}}]"),
                  "params": len(n)} for i, (g, n) in enumerate(zip(groups, names, strict=False)))


def group_params(group: Mapping, where: str, index: int) -> list:
    """`param_groups[index]["params"]` as a list (absent: empty); another type is a FormatError."""
    return values.sequence(group.get("params") or [], where, f"param_groups[{index}]['params']")


def hyper(groups: Sequence[Mapping], names: Sequence[Sequence[str]], where: str = "param_groups") -> dict:
    """The param groups' hyperparameters: group 0's `lr`, `betas`, `eps`, `weight_decay` (and
    SGD's `momentum`, `dampening`; the flags `decoupled_weight_decay`, `amsgrad`, `nesterov`,
    `maximize` where the group has them; `initial_lr` where an LR scheduler added it), plus `groups` (each group's values and its param names
    `names[g]`) when the groups differ. A value of the wrong type (`betas` a list of lists, `lr` a
    list) is a FormatError naming `where` (the file) and the group's key (`optim.groups.check_group`)."""
    from hybridckpt.optim.groups import check_group

    if not groups:
        return {}
    normed = [check_group(values.mapping(g, where, f"param_groups[{i}]"), where, f"param_groups[{i}][{{!r}}]")
              for i, g in enumerate(groups)]
    out = dict(normed[0])
    if any(n != normed[0] for n in normed[1:]):
        out["groups"] = [{**n, "params": list(p)} for n, p in zip(normed, names, strict=False)]
    return out
