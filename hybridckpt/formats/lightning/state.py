"""Lightning's own entries of a checkpoint dict: the step, the epoch, the LR schedulers, the
optimizer keyed by index.

- `global_step` (optimizer steps taken), `epoch`, `pytorch-lightning_version`, and
  `lr_schedulers` (each scheduler's `state_dict()`: `base_lrs`, `last_epoch`, `_last_lr`, ...)
  become trainer metadata, JSON as they are (`plain`: numbers, strings, lists, dicts of str keys;
  anything else its type name; bounded in depth, items and string length).
- `optimizer_states`: one torch `Optimizer.state_dict()` per optimizer `configure_optimizers`
  returned, keyed by parameter INDEX (`state[i]`, `param_groups[g]["params"]` lists of ints).
  One optimizer becomes an `IndexKeyedOptimizer` (tool "lightning"), named later from the
  model's `named_parameters()` order (`jobs.open`); one keyed by name (FSDP's full state dict,
  or groups with `param_names`) an `OptimizerState` like any named source's. Several (manual optimization, GANs) are
  refused in one line: each optimizer indexes its own parameter list, which `configure_optimizers`
  chose and no file or rule records, so no order can be checked against them (read the weights
  alone with `--format torch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridckpt import values
from hybridckpt.errors import FormatError, short_repr
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim import torch_optim
from hybridckpt.source_checkpoint import IndexKeyedOptimizer, OptimizerState

MAX_DEPTH = 8  # nesting kept of a scheduler's state
MAX_ITEMS = 4096  # values kept of all schedulers together; past it "..."
MAX_TEXT = 512  # characters of a string kept
MAX_INDEX = 1 << 40  # a parameter index past this is not one


def plain(value: Any, budget: list[int] | None = None, depth: int = 0) -> Any:
    """`value` as JSON holds it (module doc), bounded: a tensor is `"tensor[shape]"`, another
    object its type name, a non-finite float its repr."""
    budget = [MAX_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        return "..."
    if value is None or isinstance(value, (bool, int)):
        return value if not isinstance(value, int) or abs(value) < 1 << 63 else str(value)[:40]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, LazyTensor):
        return f"tensor{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [plain(v, budget, depth + 1) for v in value[: max(budget[0], 0)]]
    if isinstance(value, Mapping):
        return {str(k)[:MAX_TEXT]: plain(v, budget, depth + 1)
                for k, v in list(value.items())[: max(budget[0], 0)] if isinstance(k, (str, int))}
    return type(value).__name__


def trainer_of(obj: Mapping, where: str) -> dict:
    """`global_step`, `epoch`, the Lightning version and `lr_schedulers` of a checkpoint dict (or
    of `meta.pt`), each checked; what is absent is left out."""
    out: dict[str, Any] = {}
    for key in ("global_step", "epoch"):
        if obj.get(key) is not None:
            out[key] = values.integer(obj[key], where, repr(key))
    version = obj.get("pytorch-lightning_version")
    if version is not None:
        if not isinstance(version, str):
            raise values.wrong(where, "'pytorch-lightning_version'", "a str", version)
        out["lightning_version"] = version[:64]
    if obj.get("lr_schedulers") is not None:
        out["lr_schedulers"] = plain(values.sequence(obj["lr_schedulers"], where, "'lr_schedulers'"))
    return out


def _index(key: Any, where: str, what: str) -> int:
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < MAX_INDEX:
        raise values.wrong(where, what, "a parameter index (an int >= 0)", key)
    return key


def optimizer_of(obj: Mapping, where: str) -> tuple[IndexKeyedOptimizer | None, OptimizerState | None, list[str]]:
    """(the index-keyed optimizer, the name-keyed one, notes) of `optimizer_states`: at most one
    of the two; neither when the checkpoint holds none. Keyed by name when every `state` key is a
    name (`FSDPStrategy(state_dict_type="full")` saves FSDP's optimizer state dict so) or every
    group lists its `param_names` (an optimizer built from `named_parameters()`, torch >= 2.6);
    else by index. Several optimizers, an entry that is not a torch optimizer state dict, an index
    that is not an int, one in two groups or a state no group lists: one FormatError naming it."""
    states = obj.get("optimizer_states")
    if states is None:
        return None, None, ["no 'optimizer_states' in the checkpoint (saved without the optimizer): weights only"]
    states = values.sequence(states, where, "'optimizer_states'")
    if not states:
        return None, None, ["'optimizer_states' is empty (no optimizer): weights only"]
    if len(states) > 1:
        raise FormatError(
            f"{where}: 'optimizer_states' holds {len(states)} optimizers (configure_optimizers returned several); "
            f"each indexes its own parameter list, which no file records: only one optimizer's state can be named "
            f"(read the weights alone with --format torch)"
        )
    at = "optimizer_states[0]"
    sd = values.mapping(states[0], where, at)
    raw_state = values.mapping(sd.get("state") or {}, where, f"{at}['state']")
    raw_groups = [values.mapping(g, where, f"{at}['param_groups'][{n}]")
                  for n, g in enumerate(values.sequence(sd.get("param_groups") or [], where, f"{at}['param_groups']"))]
    named = all(isinstance(k, str) for k in raw_state) and bool(raw_state)
    with_names = bool(raw_groups) and all(
        isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(torch_optim.group_params(g, where, n))
        for n, g in enumerate(raw_groups))
    if named or with_names:
        opt = _named(raw_state, raw_groups, where, at)
        return None, opt, [f"optimizer state keyed by parameter name ({opt.num_params()} params, "
                           f"{len(raw_groups)} param groups)"]
    opt = _indexed(raw_state, raw_groups, where, at)
    return opt, None, [f"optimizer state keyed by parameter index ({len(opt.state)} params, {len(opt.groups)} param "
                       f"groups): named from the model's named_parameters() order where the config is known"]


def _named(raw_state: Mapping, raw_groups: list[Mapping], where: str, at: str) -> OptimizerState:
    """The optimizer state by parameter name (`optimizer_of`)."""
    by_index: dict[int, str] = {}
    names: list[list[str]] = []
    for g, group in enumerate(raw_groups):
        params, pnames = torch_optim.group_params(group, where, g), group.get("param_names")
        got = []
        for j, p in enumerate(params):
            if isinstance(p, str):
                got.append(p)
                continue
            name = pnames[j] if isinstance(pnames, list) and j < len(pnames) else None
            if not isinstance(name, str):
                raise values.wrong(where, f"{at}['param_groups'][{g}]['param_names'][{j}]", "a parameter name", name)
            by_index[_index(p, where, f"{at}['param_groups'][{g}]['params']")] = name
            got.append(name)
        names.append(got)
    slots: dict[str, dict[str, LazyTensor]] = {}
    steps: dict[str, float] = {}
    for key, entry in raw_state.items():
        name = key if isinstance(key, str) else by_index.get(key)
        if name is None:
            raise FormatError(f"{where}: {at}['state'] key {short_repr(key)}: no param group names it")
        got_slots, step = torch_optim.param_state(entry, f"{where}: {at}['state'][{short_repr(key)}]")
        for slot, t in got_slots.items():
            slots.setdefault(slot, {})[name] = t
        if step is not None:
            steps[name] = step
    torch_optim.check_complete(slots, where)
    step = int(max(steps.values())) if steps else None
    return OptimizerState(slots, step, hyper=torch_optim.hyper(raw_groups, names, where),
                          groups=torch_optim.group_table(raw_groups, names, where))


def _indexed(raw_state: Mapping, raw_groups: list[Mapping], where: str, at: str) -> IndexKeyedOptimizer:
    """The optimizer state by parameter index, checked (`optimizer_of`)."""
    groups: list[dict] = []
    listed: dict[int, int] = {}
    for g, group in enumerate(raw_groups):
        params = [_index(i, where, f"{at}['param_groups'][{g}]['params']")
                  for i in torch_optim.group_params(group, where, g)]
        for i in params:
            if i in listed:
                raise FormatError(f"{where}: {at}: parameter index {i} is listed twice (groups {listed[i]} and {g})")
            listed[i] = g
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    state: dict[int, dict[str, LazyTensor]] = {}
    steps: dict[int, float] = {}
    for key, entry in raw_state.items():
        i = _index(key, where, f"{at}['state'] key")
        if i not in listed:
            raise FormatError(f"{where}: {at}['state'][{i}]: no param group lists index {i} "
                              f"(groups list {short_repr(sorted(listed)[:8])})")
        slots, step = torch_optim.param_state(entry, f"{where}: {at}['state'][{i}]")
        state[i] = slots
        if step is not None:
            steps[i] = step
    torch_optim.check_same_slots({f"index {i}": s for i, s in state.items()}, where)
    return IndexKeyedOptimizer(where, "lightning", state, steps, tuple(groups))
