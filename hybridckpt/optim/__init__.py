"""Optimizers as declared slots (`base.Optimizer`), one module each, found by name.

`get("adamw")` gives an optimizer; `for_slots({"exp_avg", "exp_avg_sq"})` finds the one whose slots
a source holds. `state(...)` / `slots_of(...)` move between an optax state and `{slot: tree}`.
A new optimizer is a module in this package defining `OPTIMIZER`; nothing else changes.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import namedtuple
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from hybridckpt.errors import CheckpointError
from hybridckpt.optim.base import Optimizer, Relation, Slot

__all__ = [
    "Optimizer",
    "Relation",
    "Slot",
    "abstract_state",
    "all_optimizers",
    "for_slots",
    "get",
    "slots_of",
    "state",
]

DEFAULT = "adamw"


@cache
def all_optimizers() -> dict[str, Optimizer]:
    """Every optimizer module of this package, by name."""
    out: dict[str, Optimizer] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base":
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        opt = getattr(mod, "OPTIMIZER", None)
        if isinstance(opt, Optimizer):
            out[opt.name] = opt
    return out


def get(name: str = DEFAULT) -> Optimizer:
    opts = all_optimizers()
    if name not in opts:
        raise CheckpointError(f"optimizer {name!r} is unknown; known: {sorted(opts)}")
    return opts[name]


def for_slots(names: Iterable[str], *, where: str = "optimizer state") -> Optimizer:
    """The optimizer whose slots are exactly `names` (what a source holds per parameter)."""
    have = set(names)
    for opt in all_optimizers().values():
        if set(opt.slot_names) == have:
            return opt
    known = {n: list(o.slot_names) for n, o in all_optimizers().items()}
    raise CheckpointError(
        f"{where}: per-parameter state {sorted(have)} matches no known optimizer; known: {known}"
    )


# -- optax states by path (pure) ------------------------------------------------------------------


def _get(node: Any, path: tuple) -> Any:
    for key in path:
        node = getattr(node, key) if isinstance(key, str) and hasattr(node, "_fields") else node[key]
    return node


def _set(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if hasattr(node, "_fields") and isinstance(key, str):  # a NamedTuple state
        return node._replace(**{key: _set(getattr(node, key), rest, value)})
    if isinstance(node, tuple):
        return tuple(_set(x, rest, value) if i == key else x for i, x in enumerate(node))
    out = dict(node)
    out[key] = _set(node[key], rest, value)
    return out


def abstract_state(opt: Optimizer, param_shapes: Any, *, declared: bool = False) -> Any:
    """The optax state of `opt` for params shaped like `param_shapes`, as ShapeDtypeStructs.

    declared: built from `opt.layout` where it declares one: the same tree (the same paths,
    fields and order, the same leaves) in plain named tuples instead of optax's classes, with no
    optax imported (141 modules, about 0.07 CPU-s) and nothing traced: what an import plans, whose
    files record only the tree's paths (a restore, whose state a training loop passes to optax,
    takes optax's own)."""
    if declared and opt.layout is not None:
        return _declared_state(opt, param_shapes)
    import jax

    return jax.eval_shape(opt.make_state, param_shapes)


@cache
def _state_class(index: int, fields: tuple[str, ...]) -> type:
    """A named tuple of `fields` (jax flattens it as optax's NamedTuple states: by field, in order)."""
    return namedtuple(f"DeclaredState{index}", fields)  # noqa: PYI024 - a class per declared layout


def _declared_state(opt: Optimizer, param_shapes: Any) -> Any:
    """`abstract_state` from `opt.layout`: a slot's field is its tree shaped by its relation, of
    its param's dtype (optax's zeros like the params); the step an int32 scalar."""
    import jax
    import numpy as np

    by_path = {path: name for name, path in opt.state_paths.items()}
    states = []
    for i, fields in enumerate(opt.layout):
        values = []
        for f in fields:
            name = by_path.get((i, f))
            if name == "step":
                values.append(jax.ShapeDtypeStruct((), np.int32))
            elif name is not None:
                rel = opt.slot(name).relation
                values.append(jax.tree.map(lambda s, rel=rel: jax.ShapeDtypeStruct(rel.shape(tuple(s.shape)), s.dtype),
                                           param_shapes, is_leaf=lambda x: hasattr(x, "shape")))
            else:
                raise CheckpointError(f"optimizer {opt.name}: its layout's field {f!r} of state {i} is neither a "
                                      f"slot's nor the step's")
        states.append(_state_class(i, tuple(fields))(*values))
    return tuple(states)


def state(opt: Optimizer, template: Any, slots: Mapping[str, Any], step: Any = None) -> Any:
    """`template` (an optax state of `opt`) with each slot's tree and the step put in place
    (the step only where the optimizer keeps one)."""
    out = template
    for name, tree in slots.items():
        out = _set(out, opt.state_paths[name], tree)
    return _set(out, opt.state_paths["step"], step) if opt.has_step else out


def slots_of(opt: Optimizer, st: Any) -> tuple[dict[str, Any], Any]:
    """({slot name: tree}, step or None) of an optax state of `opt`."""
    step = _get(st, opt.state_paths["step"]) if opt.has_step else None
    return {s.name: _get(st, opt.state_paths[s.name]) for s in opt.slots}, step


def set_path(st: Any, path: tuple, value: Any) -> Any:
    """`st` with the node at `path` replaced (tuples, NamedTuples and dicts)."""
    return _set(st, path, value)
