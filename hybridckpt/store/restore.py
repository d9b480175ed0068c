"""Restore one of our checkpoints onto any mesh in one call.

The model config comes from the checkpoint's trainer state (or `config=`); the sharding plan from
`hybridckpt.plan` (the model's logical axes, or the generic rule for a model-agnostic import);
params keep the dtype they were saved in; the optimizer state (when saved and asked for) comes
back as the optax state of the optimizer named in trainer state, each slot sharded like its param
and the step counter replicated.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from hybridckpt import optim, plan
from hybridckpt.mesh import MeshShape, mesh_from_shape
from hybridckpt.naming import flatten
from hybridckpt.store.layout import Restored
from hybridckpt.store.manager import CheckpointStore


def plan_for(state: dict, saved_params: Any, mesh: jax.sharding.Mesh, *, config: Any = None,
             optimizer: optim.Optimizer | None = None, indivisible: str = "replicate") -> plan.Plan:
    """The plan of a saved checkpoint on `mesh`: by its model config, or by the generic rule
    over the saved tree's names when it has none."""
    from hybridckpt.store.as_source import model_config

    cfg = model_config(state, config)
    if cfg is not None:
        return plan.for_model(cfg, mesh, optimizer=optimizer, indivisible=indivisible)
    return plan.for_named(flatten(saved_params), mesh, optimizer=optimizer)


def restore(
    directory: str,
    mesh: jax.sharding.Mesh | MeshShape | str,
    *,
    step: int | None = None,
    optimizer: bool = True,
    config: Any = None,
    strict_sharding: bool = False,
    **restore_kwargs: Any,
) -> tuple[Any, Restored]:
    """(model config or None, Restored) of `directory` (step: latest) on `mesh`.

    optimizer: restore the optimizer state too when the step has one. strict_sharding: a dimension
    the mesh cannot divide is an error (default: replicated on that axis). Other keyword arguments go
    to `CheckpointStore.restore` (global_batch_size, allow_batch_size_change, strict).
    """
    from hybridckpt.store.as_source import model_config

    jmesh = mesh if isinstance(mesh, jax.sharding.Mesh) else mesh_from_shape(mesh)
    with CheckpointStore(os.path.abspath(directory)) as store:
        state = store.trainer_state(step)
        step = state.get("step", step) if step is None else step
        saved = store.params_metadata(step)
        has_opt = os.path.isdir(os.path.join(str(store.directory), str(step), "opt_state"))
        opt = optim.get(state.get("optimizer", optim.DEFAULT)) if optimizer and has_opt else None
        p = plan_for(state, saved, jmesh, config=config, optimizer=opt, indivisible="error" if strict_sharding else "replicate")
        restored = store.restore(
            step, target_params=p.param_targets(saved), target_opt_state=p.opt_targets(), **restore_kwargs
        )
    return model_config(state, config), restored
