"""Restore one of our checkpoints onto any mesh in one call.

The model config comes from the checkpoint's trainer state (or `config=`); the sharding plan from
`hybridckpt.plan` (the model's logical axes, or the generic rule for a model-agnostic import);
params and optimizer moments keep the dtype they were saved in (`plan.with_saved_dtypes`); the
optimizer state (when saved and asked for) comes back as the optax state of the optimizer named
in trainer state, each slot sharded like its param and the step counter replicated.
An absent folder is one error and nothing is created (the store would create it, as a training
loop's store does); another format's checkpoint (an HF folder, DCP, ...) is named as such, with
the import that makes it one of ours (`formats.registry.require_store`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import jax

from hybridckpt import optim, plan
from hybridckpt.io import timing
from hybridckpt.mesh import MeshShape, as_mesh
from hybridckpt.naming import flatten
from hybridckpt.store.layout import Restored
from hybridckpt.store.manager import CheckpointStore


def plan_for(state: dict, saved_params: Any, mesh: jax.sharding.Mesh, *, config: Any = None,
             optimizer: optim.Optimizer | None = None, indivisible: str = "replicate") -> plan.Plan:
    """The plan of a saved checkpoint on `mesh`: by its model config, or by the generic rule
    over the saved tree's names when it has none."""
    from hybridckpt.formats.orbax_store import model_config

    cfg = model_config(state, config)
    if cfg is not None:
        return plan.for_model(cfg, mesh, optimizer=optimizer, indivisible=indivisible)
    return plan.for_named(flatten(saved_params), mesh, optimizer=optimizer)


def _saved_mesh_if_it_fits(saved: Any) -> MeshShape:
    """The saved mesh (trainer state `mesh`: data) when this process has that many devices, else
    one device."""
    try:
        shape = MeshShape(**{k: int(v) for k, v in saved.items()})
    except (AttributeError, TypeError, ValueError):
        return MeshShape()
    ok = min(shape.as_dict().values()) >= 1 and shape.size <= jax.device_count()
    return shape if ok else MeshShape()


def restore(
    directory: str,
    mesh: jax.sharding.Mesh | MeshShape | str | None = None,
    *,
    step: int | None = None,
    optimizer: bool | str = True,
    config: Any = None,
    strict_sharding: bool = False,
    profile: bool = False,
    **restore_kwargs: Any,
) -> tuple[Any, Restored]:
    """(model config or None, Restored) of `directory` (step: latest) on `mesh`.

    mesh: a Mesh, a MeshShape or "dp=2,tp=4" (its sizes' product is how many devices it uses, the
      first ones); default: the mesh the checkpoint was saved on when that many devices are
      present, else one device. The saved mesh is only how the arrays lie on disk: any mesh reads
      them.

    optimizer: restore the optimizer state too when the step has one; "from-checkpoint" also
    rebuilds the optax optimizer from the hyper-parameters the import recorded (lr, betas, eps,
    weight decay and its mask: `optim.groups`) and returns the state in that optimizer's
    structure, the transformation as `restored.tx`. strict_sharding: a dimension
    the mesh cannot divide is an error (default: replicated on that axis, with a line in
    `restored.notes`; a dim made of heads or experts splits only between them). Other keyword arguments go
    to `CheckpointStore.restore` (global_batch_size, allow_batch_size_change, strict).
    profile: also account for the time (`restored.profile`: seconds, bytes and calls per stage
    and per worker, `io.timing.Profile`); off by default (nothing recorded).
    """
    from hybridckpt.errors import HybridCkptError
    from hybridckpt.io.remote.view import displayed

    try:
        with timing.account(profile) as acc:
            cfg, restored = _restore(directory, mesh, step=step, optimizer=optimizer, config=config,
                                     strict_sharding=strict_sharding, **restore_kwargs)
    except HybridCkptError as e:  # a store in a bucket: its files named by their URLs, not the local view's
        named = displayed(str(e))
        if named == str(e):
            raise
        raise type(e)(named, cli=None if e.cli is None else displayed(e.cli)) from e
    return cfg, (restored if acc is None else replace(restored, profile=acc.result()))


def _restore(directory, mesh, *, step, optimizer, config, strict_sharding, **restore_kwargs) -> tuple[Any, Restored]:
    from hybridckpt.errors import CheckpointError
    from hybridckpt.formats.orbax_store import model_config
    from hybridckpt.formats.registry import require_store

    directory = require_store(os.fspath(directory))  # (a URL: its local view, `formats.registry.store_view`)

    if not os.path.isdir(directory):  # (the store would create it)
        raise CheckpointError(f"{directory}: no such folder (expected one of our checkpoints)")
    with CheckpointStore(os.path.abspath(directory)) as store:
        with timing.stage("metadata"):
            state = store.trainer_state(step)
        if mesh is None:
            mesh = _saved_mesh_if_it_fits(state.get("mesh"))
        jmesh = as_mesh(mesh)
        step = state.get("step", step) if step is None else step
        p, params, opt_targets = targets(store, state, step, jmesh, optimizer=bool(optimizer), config=config,
                                         strict_sharding=strict_sharding)
        restored = store.restore(step, target_params=params, target_opt_state=opt_targets, **restore_kwargs)
        restored = replace(restored, notes=p.notes)
    if optimizer == "from-checkpoint":
        restored = with_optimizer(restored, p.optimizer, state, directory)
    elif not isinstance(optimizer, bool):
        raise ValueError(f"optimizer={optimizer!r}: expected True, False or 'from-checkpoint'")
    return model_config(state, config), restored


def targets(store: CheckpointStore, state: dict, step: int, mesh: jax.sharding.Mesh, *, optimizer: bool = True,
            config: Any = None, strict_sharding: bool = False) -> tuple[plan.Plan, Any, Any]:
    """(plan, params targets, optimizer-state targets or None) of `step` of `store` on `mesh`: trees
    of `jax.ShapeDtypeStruct` carrying the shardings, params and moments in their saved dtypes;
    the optimizer state's when `optimizer` and the step has one. What `restore` reads onto (and
    the restore benchmarks' Orbax peer too, `benchmarks/orbax_peer.py`)."""
    with timing.stage("metadata"):
        saved = store.params_metadata(step)
    has_opt = os.path.isdir(os.path.join(str(store.directory), str(step), "opt_state"))
    opt = optim.get(state.get("optimizer", optim.DEFAULT)) if optimizer and has_opt else None
    with timing.stage("plan"):
        p = plan_for(state, saved, mesh, config=config, optimizer=opt,
                     indivisible="error" if strict_sharding else "replicate")
    with timing.stage("metadata"):
        opt_meta = store.opt_state_metadata(step) if opt else None
    return p, p.param_targets(saved), plan.with_saved_dtypes(p.opt_targets(), opt_meta)


def with_optimizer(restored: Restored, opt: optim.Optimizer | None, state: dict, directory: str) -> Restored:
    """`restored` with `tx`, the optax optimizer rebuilt from the recorded hyper-parameters, and
    its opt_state in that optimizer's structure (slots and step moved over, nothing recomputed)."""

    from hybridckpt.errors import CheckpointError
    from hybridckpt.optim import groups

    if opt is None:
        raise CheckpointError(f"{directory}: no optimizer state saved: nothing to rebuild")
    hyper = state.get("optimizer_hyper")
    if not hyper:
        raise CheckpointError(f"{directory}: the import recorded no optimizer hyper-parameters (the source "
                              f"stores none): build the optax optimizer yourself")
    if state.get("optimizer_param_groups"):
        raise CheckpointError(f"{directory}: the source's param groups differ in what one optax optimizer "
                              f"cannot express (see trainer_state['optimizer_param_groups'])")
    tx = groups.build(opt, hyper, state.get("weight_decay_mask"), restored.params)
    slots, count = optim.slots_of(opt, restored.opt_state)
    fresh = jax.eval_shape(tx.init, restored.params)
    new = optim.state(opt, fresh, slots, count)
    leftover = [x for x in jax.tree.leaves(new) if isinstance(x, jax.ShapeDtypeStruct)]
    if leftover:
        raise CheckpointError(f"{directory}: the rebuilt {opt.name} keeps state beyond its slots and step "
                              f"({len(leftover)} arrays): not restorable from this checkpoint")
    return replace(restored, opt_state=new, tx=tx)
