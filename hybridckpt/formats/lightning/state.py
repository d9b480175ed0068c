"""Lightning's own entries of a checkpoint dict: the step, the epoch, the LR schedulers, the
optimizer keyed by index.

- `global_step` (optimizer steps taken), `epoch`, `pytorch-lightning_version`, and
  `lr_schedulers` (each scheduler's `state_dict()`: `base_lrs`, `last_epoch`, `_last_lr`, ...)
  become trainer metadata, JSON as they are (`plain`: numbers, strings, lists, dicts of str keys;
  anything else its type name; bounded in depth, items and string length).
- `optimizer_states`: one torch `Optimizer.state_dict()` per optimizer `configure_optimizers`
  returned, keyed by parameter INDEX (`state[i]`, `param_groups[g]["params"]` lists of ints).
  One optimizer becomes an `IndexKeyedOptimizer` (tool "lightning"), named later from the
  model's `named_parameters()` order (`jobs.open`). Several (manual optimization, GANs) are
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
from hybridckpt.formats import torch_optim
from hybridckpt.lazy import LazyTensor
from hybridckpt.source_checkpoint import IndexKeyedOptimizer

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


def index_optimizer(obj: Mapping, where: str) -> tuple[IndexKeyedOptimizer | None, list[str]]:
    """(the index-keyed optimizer of `optimizer_states`, notes); None when the checkpoint holds
    none. Several optimizers, an entry that is not a torch optimizer state dict, an index that is
    not an int, one in two groups or a state no group lists: one FormatError naming it."""
    states = obj.get("optimizer_states")
    if states is None:
        return None, ["no 'optimizer_states' in the checkpoint (saved without the optimizer): weights only"]
    states = values.sequence(states, where, "'optimizer_states'")
    if not states:
        return None, ["'optimizer_states' is empty (no optimizer): weights only"]
    if len(states) > 1:
        raise FormatError(
            f"{where}: 'optimizer_states' holds {len(states)} optimizers (configure_optimizers returned several); "
            f"each indexes its own parameter list, which no file records: only one optimizer's state can be named "
            f"(read the weights alone with --format torch)"
        )
    at = "optimizer_states[0]"
    sd = values.mapping(states[0], where, at)
    raw_state = values.mapping(sd.get("state") or {}, where, f"{at}['state']")
    raw_groups = values.sequence(sd.get("param_groups") or [], where, f"{at}['param_groups']")
    groups: list[dict] = []
    listed: dict[int, int] = {}
    for g, group in enumerate(raw_groups):
        group = values.mapping(group, where, f"{at}['param_groups'][{g}]")
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
    opt = IndexKeyedOptimizer(where, "lightning", state, steps, tuple(groups))
    return opt, [f"optimizer state keyed by parameter index ({len(state)} params, {len(groups)} param groups): "
                 f"named from the model's named_parameters() order where the config is known"]
