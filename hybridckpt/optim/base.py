"""Optimizer state as declared slots: what a source keeps per parameter, and where optax keeps it.

A source checkpoint stores optimizer state per parameter under the framework's names (torch's
`exp_avg`, `exp_avg_sq`, `momentum_buffer`, ...). An `Optimizer` declares those per-parameter
tensors as `Slot`s, each saying how it relates to its parameter:

- `Relation.PARAM`  same shape as the parameter (Adam's moments, SGD's momentum);
- `Relation.ROW`    the parameter's shape without its last dim (Adafactor's row statistics);
- `Relation.COLUMN` the parameter's shape without its second-to-last dim (Adafactor's columns);
- `Relation.SCALAR` one value per parameter, shape `()`.

From the relation alone follow a slot's shape, its sharding (the parameter's `PartitionSpec` with
the dropped dim removed; scalars replicated) and its mapping (a rule that renames a parameter
renames its slots; layout ops apply to PARAM slots only). The optimizer also says where its slots
live in the optax state it builds (`state_paths`), so import, export, restore and verify loop over
slots and never spell a moment's name. A new optimizer is one module beside `adamw.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class Relation(enum.Enum):
    """How a slot's shape follows from its parameter's shape."""

    PARAM = "param"
    ROW = "row"
    COLUMN = "column"
    SCALAR = "scalar"

    def shape(self, param_shape: Sequence[int]) -> tuple[int, ...]:
        """The slot's shape for a parameter of `param_shape`."""
        s = tuple(param_shape)
        if self is Relation.PARAM:
            return s
        if self is Relation.SCALAR:
            return ()
        if len(s) < 2:  # factored statistics of a vector are the vector itself
            return s
        return s[:-1] if self is Relation.ROW else s[:-2] + s[-1:]

    def spec(self, param_spec: Sequence[Any]) -> tuple[Any, ...]:
        """The slot's per-dim mesh axes from its parameter's (a PartitionSpec as a tuple)."""
        p = tuple(param_spec)
        if self is Relation.PARAM:
            return p
        if self is Relation.SCALAR:
            return ()
        if len(p) < 2:
            return p
        return p[:-1] if self is Relation.ROW else p[:-2] + p[-1:]


@dataclass(frozen=True)
class Slot:
    """One per-parameter state tensor.

    name:       the source frameworks' name (torch's optimizer `state[p][name]`), e.g. "exp_avg";
                also the suffix in our single-card export (`<hf name>.<name>`)
    state_name: the field of the optax state holding the tree of this slot, e.g. "mu"
    relation:   how its shape follows from its parameter's
    dtype:      the dtype of a fresh state's slot (numpy name; the plan's targets); a source's own
                moments keep the dtype they are stored in through import, restore and export
    """

    name: str
    state_name: str
    relation: Relation = Relation.PARAM
    dtype: str = "float32"


@dataclass(frozen=True)
class Optimizer:
    """An optimizer's state, declared.

    name:        short name ("adamw"), recorded in trainer state
    slots:       the per-parameter state tensors
    state_paths: slot name -> path (tuple of keys / indices) of its params-shaped tree inside the
                 optax state; "step" -> path of the step counter (int32 scalar), absent for an
                 optimizer that keeps none (SGD)
    make_state:  (abstract or concrete params) -> an optax state of this optimizer with the same
                 tree structure (a function of optax; imported only when called)
    step_name:   the source frameworks' name of the step counter ("step")
    layout:      the optax state `make_state` builds, declared: its chain's states in order, each
                 the tuple of its fields (adamw: `(("count", "mu", "nu"), (), ())`, optax's
                 `ScaleByAdamState` and two `EmptyState`s); every field a slot's `state_name`
                 or the step's. An import plans the state's tree from it without importing optax
                 or tracing `make_state` (`optim.abstract_state(..., declared=True)`); None: not
                 declared (`make_state` traced). tests/optim/test_declared_state.py holds it to
                 `make_state`'s tree
    build:       (hyper, mask) -> the optax transformation with a checkpoint's recorded
                 hyper-parameters (`hyper`: torch's names, `lr`, `betas`, `eps`, `weight_decay`,
                 ...; `mask`: a params-shaped tree of bools, True where weight decay applies,
                 or None for all), whose state has this optimizer's `state_paths`; None when
                 the optimizer cannot be rebuilt from a checkpoint
    """

    name: str
    slots: tuple[Slot, ...]
    state_paths: Mapping[str, tuple]
    make_state: Callable[[Any], Any]
    step_name: str = "step"
    build: Callable[[Mapping[str, Any], Any], Any] | None = None
    layout: tuple[tuple[str, ...], ...] | None = None

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"optimizer {self.name} has no slot {name!r}; slots: {self.slot_names}")

    def orbax_prefix(self, slot_name: str) -> str:
        """Dotted prefix of a slot's leaves in our Orbax `opt_state` item (e.g. "0.mu.")."""
        return ".".join(str(k) for k in self.state_paths[slot_name]) + "."

    @property
    def has_step(self) -> bool:
        return "step" in self.state_paths

    @property
    def orbax_step(self) -> str | None:
        """Dotted name of the step counter's leaf in our Orbax `opt_state` item ("0.count"), or
        None when the optimizer keeps no step."""
        path = self.state_paths.get("step")
        return None if path is None else ".".join(str(k) for k in path)
