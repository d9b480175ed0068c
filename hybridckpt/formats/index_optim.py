"""A torch `Optimizer.state_dict()` keyed by parameter INDEX, read as it stands (names come later).

torch (torch/optim/optimizer.py `state_dict`): `{"state": {i: {"step", <slot>: tensor, ...}},
"param_groups": [{"params": [i, ...], "lr", "betas", ...}]}`, where index i is the i-th
parameter the optimizer was built with, over its groups in order (`params` lists a group's
indices; torch numbers them 0..N-1 in that order). The HF Trainer's `optimizer.pt`, accelerate's
`optimizer.bin`, a Lightning `.ckpt`'s `optimizer_states[k]` and a plain loop's
`torch.save({"optimizer": opt.state_dict()})` all store it so, without the parameters' names
(`param_names` only when the optimizer was built from named parameters, which the readers use
directly). Rules checked here, each a FormatError naming the file: every index an integer,
each in one group only, every state entry's index in a group, every state entry a dict. Which
name each index has is decided where the model config is known (`optim.index_names`).
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridckpt.errors import FormatError, short_repr
from hybridckpt.optim import torch_optim
from hybridckpt.source_checkpoint import IndexKeyedOptimizer

TOOLS = ("trainer", "accelerate", "lightning", "torch")


def is_index_keyed(sd: object) -> bool:
    """Whether `sd` looks like a torch optimizer state dict keyed by index (a dict with a `state`
    dict whose keys are all integers and a `param_groups` list)."""
    if not isinstance(sd, Mapping) or not isinstance(sd.get("state"), Mapping):
        return False
    if not isinstance(sd.get("param_groups"), list):
        return False
    return all(isinstance(k, int) and not isinstance(k, bool) for k in sd["state"])


def read(sd: Mapping, path: str, tool: str) -> IndexKeyedOptimizer:
    """The index-keyed state dict `sd` (already loaded from `path`, lazily) as an
    `IndexKeyedOptimizer` for `tool` (one of `TOOLS`)."""
    assert tool in TOOLS, tool
    state, groups = sd.get("state"), sd.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise FormatError(f"{path}: expected a torch optimizer state dict ('state' a dict, 'param_groups' a list of dicts)")
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        for i in torch_optim.group_params(group, path, g):
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise FormatError(f"{path}: param_groups[{g}]['params']: expected parameter indices (integers >= 0), "
                                  f"found {short_repr(i)}")
            if i in owner:
                raise FormatError(f"{path}: param_groups[{g}]['params']: index {i} is also in group {owner[i]}")
            owner[i] = g
    slots: dict[int, dict] = {}
    steps: dict[int, float] = {}
    for key, entry in state.items():
        if not isinstance(key, int) or isinstance(key, bool) or key not in owner:
            raise FormatError(f"{path}: state[{short_repr(key)}]: expected the index of a parameter of param_groups "
                              f"(0..{len(owner) - 1})")
        got, step = torch_optim.param_state(entry, f"{path}: state[{key}]")
        slots[key] = got
        if step is not None:
            steps[key] = step
    return IndexKeyedOptimizer(path, tool, slots, steps, tuple(groups))
