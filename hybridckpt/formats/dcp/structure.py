"""Where the model and the optimizer are in a DCP checkpoint's flattened keys.

Keys are the flattened state-dict paths the saving code chose. Optimizer state is
`<opt>state.<fqn>.<slot>`: every slot the optimizer keeps under torch's own name (Adam's
`exp_avg`, `exp_avg_sq`; SGD's `momentum_buffer`; see `torch_optim`) and `.step` (0-d); the
optimizer prefix `<opt>` and the model prefix `<model>` (where `<model><fqn>` is the param) are
the pair that explains most state keys (`optim.` / `model.` for `get_state_dict`, `optimizer.` /
`` for torchtitan). Without optimizer state the model prefix comes from `planner_data` paths.
Param groups are `<opt>param_groups.N.{lr, betas, eps, weight_decay, params}`, or per fqn
`<opt>param_groups.<fqn>.lr` when the optimizer state was flattened (torch's
`flatten_optimizer_state_dict`, as torchtitan saves it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from hybridckpt.containers.dcp_metadata import DcpMetadata
from hybridckpt.formats.dcp.storage import entry_tensor, load_item
from hybridckpt.io.byte_source import ByteSource, real_reads


@dataclass(frozen=True)
class Structure:
    """Where things are in the flattened keys: `model` prefix (params are `model + fqn`) and
    `optim` prefix (per-parameter state `optim + "state." + fqn + "." + slot`); None when absent."""

    model: str
    optim: str | None


def state_split(key: str) -> list[tuple[str, str]]:
    """Candidate (optimizer prefix, fqn) splits of `<opt>state.<fqn>.<slot>`, longest fqn first."""
    body, dot, _slot = key.rpartition(".")
    if not dot:
        return []
    out = []
    for m in re.finditer(r"(?:^|\.)state\.", body):
        start = m.start() + (1 if m.group().startswith(".") else 0)
        if body[start + len("state.") :]:
            out.append((body[:start], body[start + len("state.") :]))
    return out


def find_structure(tensor_keys, planner_data: Mapping[str, tuple]) -> Structure:
    """The model and optimizer prefixes that explain the most per-parameter state keys (see
    module doc)."""
    keys = set(tensor_keys)
    splits = {k: state_split(k) for k in sorted(keys)}
    splits = {k: v for k, v in splits.items() if v}
    # candidate (model, optim) prefix pairs from a few state keys, then a vote over all of them
    pairs: set[tuple[str, str]] = set()
    for cands in list(splits.values())[:8]:
        for opt, fqn in cands:
            for t in keys:
                if t.startswith(opt + "state.") or not t.endswith(fqn):
                    continue
                if len(t) == len(fqn) or t[-len(fqn) - 1] == ".":
                    pairs.add((t[: -len(fqn)], opt))
    votes = Counter()
    for model, opt in pairs:
        votes[(model, opt)] = sum(
            1 for cands in splits.values() for o, f in cands if o == opt and model + f in keys
        )
    if votes and votes.most_common(1)[0][1] > 0:
        best = max(votes.values())
        # ties: the shortest model prefix (fewest assumptions), then the shortest optimizer one
        model, opt = min(
            (p for p, v in votes.items() if v == best), key=lambda p: (len(p[0]), len(p[1]))
        )
        return Structure(model, opt)
    # no optimizer state: the common parent path of the tensors, as the planner recorded it
    parents = []
    for k in keys:
        path = planner_data.get(k)
        if path and ".".join(map(str, path)) == k:
            parents.append(tuple(path[:-1]))
    if parents and len(set(parents)) == 1 and parents[0]:
        return Structure(".".join(map(str, parents[0])) + ".", None)
    return Structure("", None)


_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "params", "initial_lr", "momentum", "dampening", "decoupled_weight_decay",
               "amsgrad", "nesterov", "maximize")


_SMALL_ITEM = 1 << 16  # bytes: a torch.save'd hyperparameter is ~1.3 KB


def _group_value(md: DcpMetadata, fqn: str, parsed: dict[bytes, object]):
    """The byte item `fqn`, parsed once per distinct content: torch's flattened param groups
    save the same few values for every param (12 keys x 967 params of a torchtitan DeepSeek V3
    671B run are ~10 distinct archives; parsing each item was a third of `inspect`,
    docs/scale.md). `torch.save` of equal values gives equal bytes (the archive is named
    `archive`, no per-save id), so equal bytes are one value. Values are hyperparameters
    (numbers, bools, tuples, None): shared, never mutated."""
    b = md.bytes_items[fqn]
    if b.length > _SMALL_ITEM:
        return load_item(md, fqn)
    with real_reads():  # the bytes themselves, even while a read plan counts reads
        raw = ByteSource(b.path).read(b.offset, b.length)
    if raw not in parsed:
        parsed[raw] = load_item(md, fqn)
    return parsed[raw]


def param_groups(md: DcpMetadata, opt: str) -> list[dict]:
    """Param groups as dicts. Two layouts: `<opt>param_groups.N.<key>` (nested state dict) and
    `<opt>param_groups.<fqn>.<key>` (torch's flatten_optimizer_state_dict, torchtitan): the
    latter becomes one group per distinct set of values, with the fqns as `params`."""
    pre = opt + "param_groups."
    values: dict[str, dict] = {}
    parsed: dict[bytes, object] = {}
    for fqn in list(md.bytes_items) + list(md.tensors):
        if not fqn.startswith(pre):
            continue
        head, _, key = fqn[len(pre) :].rpartition(".")
        if key not in _HYPER_KEYS or not head:
            continue
        if fqn in md.tensors:
            if md.tensors[fqn].shape != ():
                continue
            value = float(entry_tensor(md.tensors[fqn]).materialize())
        else:
            value = _group_value(md, fqn, parsed)
        values.setdefault(head, {})[key] = value
    if all(h.isdigit() for h in values):
        return [values[h] for h in sorted(values, key=int)]
    groups: list[dict] = []
    for fqn, v in values.items():
        hyper = {k: v[k] for k in _HYPER_KEYS if k in v and k != "params"}
        for g in groups:
            if {k: g[k] for k in hyper} == hyper:
                g["params"].append(fqn)
                break
        else:
            groups.append({**hyper, "params": [fqn]})
    return groups
