"""Names for an optimizer state keyed by parameter index, by the rule of the tool that built it.

A torch optimizer numbers its parameters in the order it was given them, over its param groups
in order (`formats.index_optim`). Which parameter index i is follows from the model's
`named_parameters()` order (`optim.param_order`) and the tool's grouping rule:

- the HF Trainer (`Trainer.create_optimizer`, transformers 5.24): two groups, the parameters
  its weight decay applies to, then the others (`optim.trainer_groups`), each in
  `named_parameters()` order; the second group's `weight_decay` is 0;
- accelerate's `save_state` of the user's `AdamW(model.parameters())`: one group in
  `named_parameters()` order (two groups: the Trainer's grouping, accelerate driven by it);
- a plain torch loop or Lightning: one group in `named_parameters()` order, or several groups
  taking the parameters in that order one group after the other;
- `--param-order FILE` / `param_order=`: the names in index order, given; groups take them in
  order.

A mapping is accepted only when it fits the state in every recorded fact: as many parameters
as the optimizer holds, each group's size, the Trainer's no-decay group's `weight_decay` of 0,
and every state tensor's shape that of the parameter it names (a slot's declared relation,
`torch_optim.slot_shape`). Anything else is one FormatError saying what did not fit and
pointing to `--param-order`. Two parameters of the same shape swapped would fit every check:
the rule, not the shapes, places them; tests/real/test_real_index_names.py proves the rule
against the tool's own next step. Pure planning: shapes only, nothing read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.optim import torch_optim
from hybridckpt.optim.param_order import ParamOrder
from hybridckpt.optim.trainer_groups import trainer_groups
from hybridckpt.source_checkpoint import IndexKeyedOptimizer, OptimizerState

HINT = "pass --param-order FILE (the parameter names in index order, one a line; param_order= in Python)"


@dataclass(frozen=True)
class Naming:
    """A candidate naming: `groups[g][k]` names the k-th index of param group g; `label` says
    which rule gave it (what `inspect` prints); `trainer` when the Trainer's groups are claimed."""

    label: str
    groups: tuple[tuple[str, ...], ...]
    trainer: bool = False


def _sizes(ko: IndexKeyedOptimizer) -> list[int]:
    return [len(torch_optim.group_params(g, ko.path, i)) for i, g in enumerate(ko.groups)]


def _split(names: Sequence[str], sizes: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    out, at = [], 0
    for n in sizes:
        out.append(tuple(names[at:at + n]))
        at += n
    return tuple(out)


def by_rule(ko: IndexKeyedOptimizer, order: ParamOrder) -> Naming:
    """The naming the tool `ko.tool` gives (module doc), before any check."""
    sizes, where = _sizes(ko), f"named_parameters() order of {order.family}"
    if ko.tool == "trainer" or (ko.tool == "accelerate" and len(sizes) == 2):
        decay, rest = trainer_groups(order.names, order.layernorms)
        who = "the Trainer's grouping" if ko.tool == "trainer" else "the Trainer's grouping (accelerate driven by the Trainer)"
        return Naming(f"{who} ({len(decay)} decay / {len(rest)} no-decay, {where})", (tuple(decay), tuple(rest)), True)
    if len(sizes) == 1:
        return Naming(f"one group in the {where}", (order.names,))
    return Naming(f"{len(sizes)} groups taking the {where} in turn ({' / '.join(map(str, sizes))})",
                  _split(order.names, sizes))


def given(ko: IndexKeyedOptimizer, names: Sequence[str], known: Mapping[str, tuple[int, ...]], source: str) -> Naming:
    """The naming `names` (index order) gives, checked as a list: no name twice, each a
    parameter of the model (`known`), as many as the optimizer's indices. A ConfigError names
    `source` (the --param-order file) otherwise."""
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ConfigError(f"{source}: {n!r} is listed twice; expected each parameter name once")
        seen.add(n)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"{source}: names no parameter of the model has: {unknown[:3]} (it has e.g. "
                          f"{sorted(known)[:3]})")
    sizes = _sizes(ko)
    if len(names) != sum(sizes):
        raise ConfigError(f"{source}: {len(names)} names, but {os.path.basename(ko.path)} holds {sum(sizes)} parameters "
                          f"in {len(sizes)} param groups ({' / '.join(map(str, sizes))})")
    return Naming(f"the order given ({source}), groups {' / '.join(map(str, sizes))} in turn", _split(names, sizes))


def misfit(ko: IndexKeyedOptimizer, naming: Naming, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """What of the state `naming` does not fit (module doc), or None when every fact agrees."""
    sizes = _sizes(ko)
    if naming.trainer and len(sizes) != 2:
        return f"the Trainer builds 2 param groups (decay, no-decay); this state has {len(sizes)}"
    total = sum(len(g) for g in naming.groups)
    if sum(sizes) != total:
        return f"it holds {sum(sizes)} parameters, the model {total}"
    for g, (want, got) in enumerate(zip(sizes, naming.groups, strict=True)):
        if want != len(got):
            return f"param group {g} holds {want} parameters, the rule gives it {len(got)}"
    if naming.trainer:
        wd = [ko.groups[g].get("weight_decay") for g in (0, 1)]
        if wd[1] != 0:
            return f"the Trainer's no-decay group (param group 1) has weight_decay {wd[1]!r}, not 0"
    for g, names in enumerate(naming.groups):
        for i, name in zip(torch_optim.group_params(ko.groups[g], ko.path, g), names, strict=True):
            entry = ko.state.get(i, {})
            for slot, t in entry.items():
                want = torch_optim.slot_shape(sorted(entry), slot, shapes[name])
                if tuple(t.shape) != tuple(want):
                    return f"state[{i}] {slot} has shape {tuple(t.shape)}, but {name} (group {g}) needs {tuple(want)}"
    return None


def named(ko: IndexKeyedOptimizer, naming: Naming, shapes: Mapping[str, tuple[int, ...]],
          rename: Mapping[str, str] | None = None) -> tuple[OptimizerState, list[str]]:
    """(the state under names, notes): `naming` checked (`misfit`: a FormatError with `HINT`
    when anything disagrees), the slots by name (`rename` maps a naming's name to the source's
    name where they differ), the step, the hyper-parameters with each group under its names."""
    why = misfit(ko, naming, shapes)
    base = os.path.basename(ko.path)
    if why is not None:
        raise FormatError(f"{ko.path}: an optimizer state keyed by index that {naming.label} does not fit: {why}; {HINT}")
    rename = rename or {}
    slots: dict[str, dict] = {}
    steps: dict[str, float] = {}
    groups_names = [[rename.get(n, n) for n in g] for g in naming.groups]
    for g, names in enumerate(groups_names):
        for i, name in zip(torch_optim.group_params(ko.groups[g], ko.path, g), names, strict=True):
            for slot, t in ko.state.get(i, {}).items():
                slots.setdefault(slot, {})[name] = t
            if i in ko.steps:
                steps[name] = ko.steps[i]
    torch_optim.check_complete(slots, ko.path)
    values = sorted(set(steps.values()))
    step = int(values[-1]) if values else None
    notes = [f"{base} keyed by index: named by {naming.label}"]
    if len(values) > 1:
        notes.append(f"{ko.path}: params have different optimizer steps {values[:5]}; using {step}")
    hyper = torch_optim.hyper(ko.groups, groups_names, ko.path)
    return OptimizerState(slots, step, hyper=hyper, groups=torch_optim.group_table(ko.groups, groups_names, ko.path)), notes
