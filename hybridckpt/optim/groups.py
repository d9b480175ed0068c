"""A checkpoint's optimizer hyper-parameters, as recorded and as optax rebuilds them.

Sources record hyper-parameters per torch param group (`OptimizerState.hyper`: group 0's `lr`,
`betas`, `eps`, `weight_decay`, ..., and `groups`, each group's values with its param names,
when the groups differ). optax has one optimizer over the whole tree; the only per-param
difference it takes is which params decay (`optax.adamw(..., mask=)`), so groups may differ in
`weight_decay` alone, and only between one value and 0 (HF Trainer's and Megatron's no-decay
group of biases and norms). `weight_decay_mask` turns the groups into that mask over the
imported tree's leaves; `recorded` is what import keeps in trainer state (`optimizer_hyper`,
`weight_decay_mask`), `build` the optax transformation from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hybridckpt import values
from hybridckpt.errors import CheckpointError

SCALARS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "decoupled_weight_decay",
           "amsgrad", "nesterov", "maximize", "initial_lr")  # (initial_lr: an LR scheduler's peak, kept for exports)
FLOATS = ("lr", "eps", "weight_decay", "momentum", "dampening", "initial_lr")
FLAGS = ("decoupled_weight_decay", "amsgrad", "nesterov", "maximize")


def check_group(group: Mapping, where: str, key: str = "{}") -> dict:
    """The hyper-parameters of one param group (`FLOATS` as floats, `FLAGS` as bools, `betas` as a
    list of floats; keys absent or None left out), read from a file: a value of another type is a
    FormatError naming `where`, the key (as `key.format(name)`), what was expected and found
    (`values`)."""
    out: dict[str, Any] = {}
    for k in FLOATS:
        if group.get(k) is not None:
            out[k] = values.number(group[k], where, key.format(k))
    for k in FLAGS:
        if group.get(k) is not None:
            out[k] = values.flag(group[k], where, key.format(k))
    if group.get("betas") is not None:
        out["betas"] = values.numbers(group["betas"], where, key.format("betas"))
    return out


def checked_hyper(hyper: Mapping[str, Any], where: str) -> dict:
    """`hyper` (a source's `OptimizerState.hyper`: group 0's values and maybe `groups`) with every
    known value checked as `check_group` does, each group's `params` a list of names or indices;
    other keys kept as they are."""
    hyper = values.mapping(hyper, where, "optimizer hyper-parameters")
    out = {k: v for k, v in hyper.items() if k not in (*FLOATS, *FLAGS, "betas")}
    out.update(check_group(hyper, where, "optimizer hyper-parameter {!r}"))
    if hyper.get("groups") is not None:
        groups = []
        for i, g in enumerate(values.sequence(hyper["groups"], where, "param groups")):
            g = values.mapping(g, where, f"param group {i}")
            params = values.sequence(g.get("params") or [], where, f"param group {i} 'params'")
            if not all(isinstance(n, (str, int)) and not isinstance(n, bool) for n in params):
                raise values.wrong(where, f"param group {i} 'params'", "a list of names or indices", params)
            groups.append({**g, **check_group(g, where, f"param group {i} {{!r}}"), "params": params})
        out["groups"] = groups
    return out


def _decays(groups: list[Mapping], where: str) -> tuple[float, list[bool]]:
    """(the one non-zero weight decay, per group whether it decays); a CheckpointError when the
    groups differ in anything optax cannot express per param."""
    base = {k: v for k, v in groups[0].items() if k in SCALARS and k != "weight_decay"}
    for i, g in enumerate(groups[1:], 1):
        other = {k: v for k, v in g.items() if k in SCALARS and k != "weight_decay"}
        if other != base:
            diff = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise CheckpointError(f"{where}: param groups 0 and {i} differ in {diff}: one optax optimizer "
                                  "takes per-param weight decay only")
    wds = {float(g.get("weight_decay", 0.0)) for g in groups}
    nonzero = sorted(w for w in wds if w)
    if len(nonzero) > 1:
        raise CheckpointError(f"{where}: param groups decay by {sorted(wds)}: optax's mask takes one weight decay and 0")
    return (nonzero[0] if nonzero else 0.0), [bool(g.get("weight_decay", 0.0)) for g in groups]


def weight_decay_mask(hyper: Mapping[str, Any], leaf_of: Callable[[str], Iterable[str]], leaves: Iterable[str],
                      where: str) -> tuple[dict, dict[str, bool] | None]:
    """(scalar hyper-parameters, {leaf: decays} or None when every param decays alike).

    leaf_of: a source param name -> the names of the leaves it ends in (the import's renames);
    leaves: every leaf of the imported tree. A leaf fed by groups that disagree, or a leaf no
    group names, is a CheckpointError naming it."""
    scalars = {k: hyper[k] for k in SCALARS if k in hyper}
    groups = hyper.get("groups")
    if not groups:
        return scalars, None
    wd, decays = _decays(list(groups), where)
    scalars["weight_decay"] = wd
    if len(set(decays)) == 1:
        return scalars, None
    mask: dict[str, bool] = {}
    for g, decay in zip(groups, decays, strict=True):
        for name in g.get("params") or []:
            for leaf in leaf_of(str(name)):
                if mask.setdefault(leaf, decay) != decay:
                    raise CheckpointError(f"{where}: {leaf!r} holds params of a decayed and an undecayed group "
                                          "(optax's mask is per array)")
    missing = sorted(set(leaves) - set(mask))
    if missing:
        raise CheckpointError(f"{where}: no param group names the params of {missing[:5]}: the weight decay "
                              "mask would guess")
    return scalars, {k: mask[k] for k in leaves}


def build(opt: Any, scalars: Mapping[str, Any], mask: Mapping[str, bool] | None, params: Any) -> Any:
    """The optax transformation of optimizer `opt` (`optim.Optimizer`) from recorded
    hyper-parameters, the mask laid over `params` (a nested dict tree whose flattened dotted
    names are the mask's keys)."""
    if opt.build is None:
        raise CheckpointError(f"optimizer {opt.name}: cannot be rebuilt from recorded hyper-parameters")
    tree = None
    if mask is not None:
        tree = _nest_like(params, mask)
    return opt.build(scalars, tree)


def _nest_like(params: Any, mask: Mapping[str, bool], prefix: str = "") -> Any:
    if isinstance(params, Mapping):
        return {k: _nest_like(v, mask, f"{prefix}{k}.") for k, v in params.items()}
    name = prefix[:-1]
    if name not in mask:
        raise CheckpointError(f"weight decay mask: no entry for {name!r}")
    return bool(mask[name])
