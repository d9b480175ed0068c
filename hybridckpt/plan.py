"""The sharding plan: where every param and optimizer leaf lives on a mesh. Computed here only.

Input: a model config (its param shapes and logical axes come from the family's param table in
`models`, nothing traced) or, for a model the
project does not know, a plain named tree of shapes; a `jax.sharding.Mesh` over
("dp", "fsdp", "tp", "pp"); and optionally an optimizer (`hybridckpt.optim`). Output: a `Plan`
holding, for params and optimizer state alike, the `NamedSharding` of every leaf and the abstract
targets (`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`) that import, restore, logits, verify
and export all use.

- Model params: each dim's logical axis maps to a mesh axis by `mesh.DEFAULT_RULES`
  (`embed->fsdp`, `heads/kv_heads/mlp/vocab->tp`, `layers->pp`, `experts->dp`), overridden by
  `axis_rules` or `$HYBRIDCKPT_AXIS_RULES` (`mesh.axis_rules`). A dim made of heads or experts
  (the table's groups, `models.param_groups_tree`) divides only when the mesh axes divide its
  count (2 kv heads of 8 values on tp=4 do not). A dim the mesh axis cannot divide (GPT-2's
  vocabulary 50257 on tp=2) is replicated on that axis, with one note per kind of group naming
  its leaves and real count and one note naming every other such dim (`indivisible="replicate"`,
  the jobs' default, `mesh.replication_notes`), or is an error (`"error"`, the CLI's
  `--strict-sharding`).
- Named trees (no model): the generic rule. For each tensor, `fsdp` shards the largest dim it
  divides (the first such dim on ties); then `tp` shards the largest remaining dim it divides;
  `dp` and `pp` replicate. 0-d tensors and tensors no axis divides are replicated.
- Optimizer slots follow their param through the slot's relation (`optim.Relation.spec`): a
  moment shaped like its param is sharded like it, a row statistic drops the last dim's axis, a
  scalar is replicated; the step counter and any other state leaf are replicated.
- `box_owners`: of all devices holding the same box of an array, the one with the lowest id owns
  it (reads it for checksums, counts it once across processes).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridckpt import optim
from hybridckpt.lazy import Box, normalize_box
from hybridckpt.mesh import Replicated, replicated, replication_notes, tree_shardings
from hybridckpt.mesh import axis_rules as merged_axis_rules
from hybridckpt.naming import flatten, nest


def _has_shape(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def abstract_tree(shapes_tree: Any, shardings_tree: Any, dtype: Any = None) -> Any:
    """`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` for every leaf of `shapes_tree`.

    shapes_tree: a pytree whose leaves have `.shape` and `.dtype` (ShapeDtypeStruct, arrays,
      the output of `jax.eval_shape` or `store.load_params_metadata`).
    shardings_tree: the same structure with a `Sharding` per leaf, or one `Sharding` for all.
    dtype: if given, replaces the dtype of floating-point leaves only (integer counters such as
      adam's `count` keep theirs).
    """
    leaves, treedef = jax.tree_util.tree_flatten(shapes_tree, is_leaf=_has_shape)
    if isinstance(shardings_tree, jax.sharding.Sharding):
        shardings = [shardings_tree] * len(leaves)
    else:
        shardings = treedef.flatten_up_to(shardings_tree)
    out = []
    for leaf, sharding in zip(leaves, shardings, strict=True):
        dt = np.dtype(leaf.dtype)
        if dtype is not None and jax.numpy.issubdtype(dt, np.floating):
            dt = np.dtype(dtype)
        out.append(jax.ShapeDtypeStruct(tuple(leaf.shape), dt, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclass(frozen=True)
class Plan:
    """Shardings and abstract targets of params (and optimizer state) on one mesh.

    param_shapes:    nested dict of `jax.ShapeDtypeStruct` (fp32 for a model; as stored for a
                     named tree), no sharding
    param_shardings: the same structure, a `NamedSharding` per leaf
    chunk_axes:      the same structure, per leaf the axes chunked with extent 1 when written
                     (`(0,)` for a stacked `[layers, ...]` leaf: one layer per chunk), else ()
    optimizer:       the declared optimizer, or None (params only)
    opt_shapes:      its optax state as `jax.ShapeDtypeStruct`s (None without an optimizer)
    opt_shardings:   the same structure, a `NamedSharding` per leaf
    notes:           one line per dimension replicated because the mesh could not divide it
    """

    mesh: Mesh
    param_shapes: Any
    param_shardings: Any
    chunk_axes: Any
    optimizer: optim.Optimizer | None = None
    opt_shapes: Any = None
    opt_shardings: Any = None
    notes: tuple[str, ...] = ()

    def param_targets(self, shapes: Any = None, dtype: Any = None) -> Any:
        """Abstract targets of the params; `shapes` (e.g. the saved metadata, to keep the
        saved dtypes) replaces `param_shapes` when given."""
        return abstract_tree(self.param_shapes if shapes is None else shapes, self.param_shardings, dtype)

    def opt_targets(self) -> Any:
        """Abstract targets of the optimizer state (None without an optimizer)."""
        if self.optimizer is None:
            return None
        return abstract_tree(self.opt_shapes, self.opt_shardings)

    def slot_shardings(self, slot_name: str) -> Any:
        """The tree of shardings of one slot (same structure as the params)."""
        assert self.optimizer is not None
        return _get(self.opt_shardings, self.optimizer.state_paths[slot_name])

    @property
    def step_sharding(self) -> NamedSharding:
        return replicated(self.mesh)

    def with_optimizer(self, optimizer: optim.Optimizer | None, *, declared: bool = False) -> Plan:
        """This plan with (another) optimizer's state planned beside the params; `declared`: its
        tree from the optimizer's declared layout, optax not imported (`optim.abstract_state`)."""
        if optimizer is None:
            return Plan(self.mesh, self.param_shapes, self.param_shardings, self.chunk_axes, notes=self.notes)
        shapes = optim.abstract_state(optimizer, self.param_shapes, declared=declared)
        rep = replicated(self.mesh)
        shardings = jax.tree.map(lambda _: rep, shapes, is_leaf=_has_shape)
        for slot in optimizer.slots:
            tree = jax.tree.map(
                lambda s, slot=slot: NamedSharding(s.mesh, _slot_spec(slot.relation, s.spec)),
                self.param_shardings,
            )
            shardings = optim.set_path(shardings, optimizer.state_paths[slot.name], tree)
            # a slot's shape and dtype are declared (an fp32 moment of a bf16 param stays fp32)
            slot_shapes = jax.tree.map(
                lambda s, slot=slot: jax.ShapeDtypeStruct(slot.relation.shape(s.shape), np.dtype(slot.dtype)),
                self.param_shapes,
                is_leaf=_has_shape,
            )
            shapes = optim.set_path(shapes, optimizer.state_paths[slot.name], slot_shapes)
        return Plan(
            self.mesh, self.param_shapes, self.param_shardings, self.chunk_axes, optimizer, shapes,
            shardings, self.notes,
        )


def _key_name(key: Any) -> str:
    """One step of a tree path as text (`SequenceKey` 0, `DictKey` "mu", `GetAttrKey` "mu")."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def with_saved_dtypes(targets: Any, saved: Any) -> Any:
    """`targets` (abstract arrays with shardings) with each floating leaf's dtype the one `saved`
    (a tree of the saved arrays' `ShapeDtypeStruct`s, matched by dotted path: `0.mu.layers.q.kernel`,
    whatever the containers) records for it: a bf16 moment stored as bf16 restores as bf16.
    Leaves `saved` does not hold keep their dtype."""
    if targets is None or saved is None:
        return targets
    stored = {
        ".".join(_key_name(k) for k in path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(saved, is_leaf=_has_shape)[0]
        if _has_shape(leaf)
    }

    def one(path: tuple, t: Any) -> Any:
        dt = stored.get(".".join(_key_name(k) for k in path))
        if dt is None or not jax.numpy.issubdtype(t.dtype, np.floating) or not jax.numpy.issubdtype(dt, np.floating):
            return t
        return jax.ShapeDtypeStruct(t.shape, np.dtype(dt), sharding=t.sharding)

    return jax.tree_util.tree_map_with_path(one, targets, is_leaf=_has_shape)


def _get(node: Any, path: tuple) -> Any:
    for key in path:
        node = getattr(node, key) if isinstance(key, str) and hasattr(node, "_fields") else node[key]
    return node


def _slot_spec(relation: optim.Relation, spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(*relation.spec(tuple(spec)))


def _stacked_axes(axes: Any) -> Any:
    """Per leaf: `(0,)` when its first logical axis is `layers` (chunk it per layer), else ()."""
    return jax.tree.map(lambda a: (0,) if a and a[0] == "layers" else (), axes, is_leaf=lambda x: isinstance(x, tuple))


def _model_shapes_axes_groups(cfg: Any) -> tuple[Any, Any, Any]:
    """(tree of fp32 `ShapeDtypeStruct`, tree of logical-axis tuples, tree of per-dim groups) of
    `cfg`'s params, from the family's param table (`models.param_shape_tree`,
    `models.param_axes_tree`, `models.param_groups_tree`): no Flax module is imported or traced."""
    from hybridckpt import models

    def is_leaf(x):
        return isinstance(x, tuple)

    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), models.param_shape_tree(cfg), is_leaf=is_leaf)
    axes = jax.tree.map(lambda a: a, models.param_axes_tree(cfg), is_leaf=is_leaf)  # (keys sorted)
    groups = jax.tree.map(lambda g: g, models.param_groups_tree(cfg), is_leaf=is_leaf)
    return shapes, axes, groups


def for_model(
    cfg: Any,
    mesh: Mesh,
    *,
    optimizer: optim.Optimizer | None = None,
    indivisible: str = "replicate",
    axis_rules: Mapping[str, Any] | str | None = None,
    declared: bool = False,
) -> Plan:
    """The plan of `cfg`'s params (fp32, logical axes from `models`) and optimizer on `mesh`.

    axis_rules: overrides of `mesh.DEFAULT_RULES` (a mapping or `experts=fsdp` text); None
    reads `$HYBRIDCKPT_AXIS_RULES`. declared: the optimizer state's tree from its declared
    layout, not optax's classes (`Plan.with_optimizer`: an import's)."""
    shapes, axes, groups = _model_shapes_axes_groups(cfg)
    replicated_dims: list[Replicated] = []
    rules = merged_axis_rules(axis_rules)
    shardings = tree_shardings(shapes, axes, mesh, rules=rules, indivisible=indivisible, notes=replicated_dims,
                               groups=groups)
    notes = replication_notes(replicated_dims)
    return Plan(mesh, shapes, shardings, _stacked_axes(axes), notes=notes).with_optimizer(optimizer, declared=declared)


def generic_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The generic rule for a tensor of no known model: `fsdp` on the largest dim it divides,
    then `tp` on the largest remaining dim it divides; everything else replicated."""
    spec: list[Any] = [None] * len(shape)
    for axis in ("fsdp", "tp"):
        n = int(mesh.shape.get(axis, 1))
        if n <= 1:
            continue
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % n == 0]
        if free:
            best = max(free, key=lambda d: (shape[d], -d))
            spec[best] = axis
    return PartitionSpec(*spec)


def for_named(
    shapes: Mapping[str, Any], mesh: Mesh, *, optimizer: optim.Optimizer | None = None, declared: bool = False
) -> Plan:
    """The plan of a flat named tree (`{"a.b.c": ShapeDtypeStruct}`, dotted names nest) by the
    generic rule, and of its optimizer state (`declared`: see `for_model`)."""
    flat = {k: jax.ShapeDtypeStruct(tuple(v.shape), np.dtype(v.dtype)) for k, v in shapes.items()}
    shardings = {k: NamedSharding(mesh, generic_spec(v.shape, mesh)) for k, v in flat.items()}
    chunks = {k: () for k in flat}
    return Plan(mesh, nest(flat), nest(shardings), nest(chunks)).with_optimizer(optimizer, declared=declared)


def optax_state_shardings(opt_state_shapes, param_shardings, mesh: Mesh):
    """Shardings for ANY optax state a training loop builds (not only a declared optimizer's):
    every subtree shaped like the params (adam `mu`, `nu`, momentum) is sharded like the params;
    every other leaf (counters, scalars) is replicated."""
    param_def = jax.tree_util.tree_structure(param_shardings)
    rep = replicated(mesh)

    def is_param_tree(x):
        try:
            return jax.tree_util.tree_structure(x) == param_def
        except Exception:  # noqa: BLE001 - arbitrary optax state nodes
            return False

    def shard(x):
        if is_param_tree(x):
            return param_shardings
        return jax.tree_util.tree_map(lambda _: rep, x)

    return jax.tree_util.tree_map(shard, opt_state_shapes, is_leaf=is_param_tree)


# -- who reads which box ----------------------------------------------------------------------------


def box_holders(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict[Box, list]:
    """Each distinct box of this process's devices -> the addressable devices holding it."""
    out: dict[Box, list] = {}
    for dev, index in sharding.addressable_devices_indices_map(shape).items():
        out.setdefault(normalize_box(shape, index), []).append(dev)
    return out


def box_owners(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict[Box, Any]:
    """Each distinct box of the array (all processes) -> the device that owns it: the lowest
    device id among those holding it. Its process reads it for checksums; it is counted once.
    A fresh dict each call; computed once per (shape, sharding) among the last `OWNERS_KEPT`
    (a model's leaves share a few: a one-host plan of a 671B MoE asked 270k times for 30)."""
    try:
        return dict(_owners(tuple(int(n) for n in shape), sharding))
    except TypeError:  # a sharding that cannot be hashed: computed every time
        return dict(_owners.__wrapped__(tuple(int(n) for n in shape), sharding))


OWNERS_KEPT = 64  # (shape, sharding) pairs whose owners are kept (~100 KiB each at 512 devices)


@functools.lru_cache(maxsize=OWNERS_KEPT)
def _owners(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[tuple[Box, Any], ...]:
    owner: dict[Box, Any] = {}
    for dev, index in sharding.devices_indices_map(shape).items():
        box = normalize_box(shape, index)
        if box not in owner or dev.id < owner[box].id:
            owner[box] = dev
    return tuple(owner.items())


def flat_shardings(tree: Any) -> dict[str, Any]:
    """`{"a.b": sharding}` of a nested dict of shardings (dicts only)."""
    return flatten(tree)
