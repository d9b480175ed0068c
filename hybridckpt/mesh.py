"""Meshes over ("dp", "fsdp", "tp", "pp") and the NamedSharding of every param and optimizer leaf.

A parameter carries logical axis names per dimension (e.g. a kernel `[embed, heads]`); the
logical-axis rules below map each name to a mesh axis. A dimension whose mesh axis does not
divide it is an error naming the tensor, the dimension and the sizes, unless the caller asks for
`indivisible="replicate"`, which leaves that one dimension unsharded (documented fallback).

A dimension made of groups (a model's param table says which: `models.table.Groups`, e.g.
q_proj's `heads * head_dim` is `num_heads` heads, an MoE weight's leading dim its experts) is
split only between groups: the mesh axes must divide the number of groups, not merely the size.
6 q heads of 8 values (48) on tp=4 would cut 1.5 heads a device: that dimension is replicated on
tp instead (or an error), and the note names the real count: "heads 6 do not divide over tp=4".

`experts` (the expert axis of mixture-of-experts weights `[layers, experts, ...]` and of their
optimizer moments) maps to `dp` by default. Megatron-Core and DeepSpeed build their
expert-parallel groups out of data-parallel ranks (EP divides DP: NVIDIA/Megatron-LM
megatron/core/parallel_state.py `initialize_model_parallel`, expert_model_parallel_size;
deepspeedai/DeepSpeed deepspeed/utils/groups.py `_create_expert_and_data_parallel`), so the
experts split over `dp` while their inner dims still split over `fsdp` / `tp` and the layers
over `pp`: on any mesh with more than one device, no device holds every expert. Without this
rule `dp` would shard nothing of the params and each dp replica would hold all the experts.

Users change the mapping with `$HYBRIDCKPT_AXIS_RULES` (`axis_rules`): comma-separated
`logical=mesh` entries overriding the defaults, a mesh value of `none` meaning replicated and
`a+b` meaning several mesh axes: `HYBRIDCKPT_AXIS_RULES=experts=fsdp` or `experts=dp+fsdp`.
It applies wherever a plan is made (import, restore, logits); library callers may pass
`axis_rules` to `plan.for_model` instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridckpt.errors import MeshError, short_repr
from hybridckpt.mesh_shape import AXIS_RULES_ENV, MESH_AXES, MeshShape  # noqa: F401 - (re-exported)

# logical axis name -> mesh axis (or tuple of axes); names not listed are replicated
DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": ("dp", "fsdp"),
    "embed": "fsdp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "vocab": "tp",
    "layers": "pp",
    "experts": "dp",  # expert parallelism is carved out of data parallelism (module docstring)
}

def axis_rules(overrides: Mapping[str, str | tuple[str, ...] | None] | str | None = None) -> dict:
    """DEFAULT_RULES with overrides: a mapping, or text `experts=fsdp,mlp=none,embed=dp+fsdp`;
    None reads `$HYBRIDCKPT_AXIS_RULES` (empty or unset: the defaults)."""
    if overrides is None:
        overrides = os.environ.get(AXIS_RULES_ENV, "")
    rules = dict(DEFAULT_RULES)
    if isinstance(overrides, str):
        where = f"axis rules {overrides!r} (${AXIS_RULES_ENV})"
        parsed: dict[str, str | tuple[str, ...] | None] = {}
        for part in filter(None, (p.strip() for p in overrides.split(","))):
            key, eq, value = (x.strip() for x in part.partition("="))
            axes = tuple(a.strip() for a in value.split("+"))
            if not key or not eq or not (value == "none" or all(a in MESH_AXES for a in axes)):
                raise MeshError(
                    f"bad {where}: {part!r}; expected logical=mesh entries, mesh one of "
                    f"{', '.join(MESH_AXES)}, 'a+b' or 'none'"
                )
            parsed[key] = None if value == "none" else axes[0] if len(axes) == 1 else axes
        overrides = parsed
    rules.update(overrides)
    return rules


def make_mesh(
    dp: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    pp: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A Mesh with axes ("dp", "fsdp", "tp", "pp") over the first `dp*fsdp*tp*pp` of `devices`
    (default: `jax.devices()`), as the CLI and every job build theirs (README "Choosing a
    mesh"); more devices than are there is an error saying how to get them."""
    shape = MeshShape(dp, fsdp, tp, pp)
    for axis, size in shape.as_dict().items():
        if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh {axis}={size!r}: sizes must be positive integers")
    devs = list(jax.devices() if devices is None else devices)
    if shape.size > len(devs):
        raise _too_few_devices(shape, devs, given=devices is not None)
    grid = np.array(devs[: shape.size], dtype=object).reshape(dp, fsdp, tp, pp)
    return Mesh(grid, MESH_AXES)


def _too_few_devices(shape: MeshShape, devs: Sequence[jax.Device], given: bool = False) -> MeshError:
    """The error for a mesh larger than the devices present (or `given`), saying how to get more
    CPU devices (JAX starts with one; the `hybridckpt` command simulates 8)."""
    what = f"mesh {shape} needs {shape.size} devices but only {len(devs)} {'are given' if given else 'exist'}"
    if given or not devs or devs[0].platform != "cpu":
        return MeshError(what)
    flag = f"--xla_force_host_platform_device_count={shape.size}"
    return MeshError(
        f"{what}; on a CPU, simulate them: os.environ['XLA_FLAGS'] = '{flag}' before JAX is imported",
        cli=f"{what}; on a CPU, simulate them: XLA_FLAGS={flag} hybridckpt ... (the command simulates 8 otherwise)",
    )


def mesh_from_shape(shape: MeshShape | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """`make_mesh` from a MeshShape or a `dp=..,tp=..` string: on the first `shape.size` devices."""
    if isinstance(shape, str):
        shape = MeshShape.parse(shape)
    return make_mesh(**shape.as_dict(), devices=devices)


def as_mesh(mesh: Mesh | MeshShape | str) -> Mesh:
    """The one coercion of a job's `mesh=` argument: a Mesh as it is; a MeshShape or text like
    "dp=2,tp=4" on the first devices its sizes multiply to (`mesh_from_shape`)."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, MeshShape | str):
        return mesh_from_shape(mesh)
    raise MeshError(f"mesh {short_repr(mesh)}: expected a jax.sharding.Mesh, a MeshShape or text like 'dp=2,tp=4'")


@dataclass(frozen=True)
class Replicated:
    """One dimension of a tensor left whole on mesh axes that cannot divide it.

    leaf: the tensor's name ("layers.k.kernel"); dim: which dimension; logical: its logical axis;
    size: its size (values); axes / n: the mesh axes and their total size; groups: the
    `(what, count)` the dim is made of (`models.table.Groups`: "kv_heads", 2), or None.
    """

    leaf: str
    dim: int
    logical: str
    size: int
    axes: tuple[str, ...]
    n: int
    groups: tuple[str, int] | None = None

    def __str__(self) -> str:
        return f"{self.leaf} dim {self.dim} ({self.logical} {self.size} over {'*'.join(self.axes)}={self.n})"


def _divide(what: str, count: int, axes: tuple[str, ...], n: int) -> str:
    """The words `kv_heads 2 do not divide over tp=4` of a note or an error."""
    return f"{what} {count} {'does' if count == 1 else 'do'} not divide over {'*'.join(axes)}={n}"


def replication_notes(records: Sequence[Replicated]) -> tuple[str, ...]:
    """The notes of a plan's replicated dimensions: one line per kind of group, count and mesh
    axes ("kv_heads 2 do not divide over tp=4: layers.k.kernel, layers.v.kernel replicated on
    tp (--strict-sharding makes this an error)"), then one line for every other dimension."""
    grouped: dict[tuple, list[str]] = {}
    plain: list[str] = []
    for r in records:
        if r.groups is None:
            plain.append(str(r))
        else:
            grouped.setdefault((*r.groups, r.axes, r.n), []).append(r.leaf)
    out = [f"{_divide(what, count, axes, n)}: {', '.join(dict.fromkeys(leaves))} replicated on "
           f"{'*'.join(axes)} (--strict-sharding makes this an error)"
           for (what, count, axes, n), leaves in grouped.items()]
    if plain:
        out.append("replicated where the mesh cannot divide a dimension (--strict-sharding makes this an "
                   "error): " + "; ".join(plain))
    return tuple(out)


def partition_spec(
    name: str,
    shape: Sequence[int],
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    *,
    rules: Mapping[str, str | tuple[str, ...] | None] = DEFAULT_RULES,
    indivisible: str = "error",
    notes: list[Replicated] | None = None,
    groups: Sequence[Any] | None = None,
) -> PartitionSpec:
    """The PartitionSpec of one tensor `name` with `logical_axes` per dim on `mesh`.

    groups: per dim None or the `(what, count)` it is made of (`models.table.Groups`): its mesh
      axes must divide `count` (a split between heads), not merely the size.
    indivisible: "error" (MeshError naming tensor, dim, axis and sizes, or the groups' count)
    or "replicate" (that dim stays whole on those axes; a `Replicated` record is appended to
    `notes` when given: `replication_notes` words them).
    """
    if len(logical_axes) != len(shape):
        raise MeshError(f"{name}: {len(shape)} dims {tuple(shape)} but logical axes {logical_axes}")
    groups = tuple(groups) if groups else (None,) * len(shape)
    if len(groups) != len(shape):
        raise MeshError(f"{name}: {len(shape)} dims {tuple(shape)} but groups {groups}")
    used: set[str] = set()
    spec = []
    for dim, (size, logical, group) in enumerate(zip(shape, logical_axes, groups, strict=True)):
        axes = rules.get(logical) if logical else None
        if axes is None:
            spec.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        n = math.prod(mesh.shape[a] for a in axes)
        if not axes:
            spec.append(None)
            continue
        group = None if group is None else (str(group[0]), int(group[1]))
        if (group[1] if group else size) % n:
            if indivisible == "replicate":
                if notes is not None:
                    notes.append(Replicated(name, dim, logical, size, axes, n, group))
                spec.append(None)
                continue
            if group:
                what = (f"{name}: {_divide(*group, axes, n)} (dim {dim} of shape {tuple(shape)}: {group[1]} "
                        f"{group[0]} of {size // group[1]}); choose another mesh or drop")
            else:
                what = (f"{name}: dim {dim} ({logical}) has size {size}, which mesh axes {axes} of total "
                        f"size {n} cannot divide (shape {tuple(shape)}); choose another mesh or drop")
            raise MeshError(f"{what} strict_sharding=True to replicate that dimension",
                            cli=f"{what} --strict-sharding to replicate that dimension")
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def tree_shardings(
    shapes,
    logical_axes,
    mesh: Mesh,
    *,
    rules: Mapping[str, str | tuple[str, ...] | None] = DEFAULT_RULES,
    indivisible: str = "error",
    notes: list[Replicated] | None = None,
    groups: Any = None,
):
    """NamedShardings for a pytree of shapes (anything with `.shape`) given a matching pytree of
    logical-axis tuples (and optionally of per-dim groups: `partition_spec`); `notes` collects a
    `Replicated` record per replicated indivisible dimension."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    axes_leaves = treedef.flatten_up_to(logical_axes)
    group_leaves = [None] * len(flat) if groups is None else treedef.flatten_up_to(groups)
    out = []
    for (path, leaf), axes, group in zip(flat, axes_leaves, group_leaves, strict=True):
        spec = partition_spec(
            jax.tree_util.keystr(path, simple=True, separator="."),
            leaf.shape,
            tuple(axes),
            mesh,
            rules=rules,
            indivisible=indivisible,
            notes=notes,
            groups=group,
        )
        out.append(NamedSharding(mesh, spec))
    return jax.tree_util.tree_unflatten(treedef, out)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Tokens `[batch, seq, ...]`: batch over ("dp", "fsdp"), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(("dp", "fsdp"), *([None] * (ndim - 1))))
