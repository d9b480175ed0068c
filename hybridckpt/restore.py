"""Restore a hybridckpt Orbax checkpoint onto any mesh in one call.

The model config comes from the checkpoint's trainer state; params keep the dtype they were
saved in; the optax AdamW state (when saved and asked for) comes back with `mu`/`nu` sharded like
the params and `count` replicated.
"""

from __future__ import annotations

import os

import jax

from hybridckpt.checkpoint import CheckpointStore, Restored, abstract_tree
from hybridckpt.mesh import MeshShape, mesh_from_shape, opt_state_shardings, tree_shardings


def adamw_state(params, mu, nu, count: int):
    """An `optax.adamw` state holding the given moments and step count (count int32)."""
    import jax.numpy as jnp
    import optax

    state = jax.eval_shape(optax.adamw(1e-3).init, params)
    first = state[0]._replace(count=jnp.asarray(count, dtype=jnp.int32), mu=mu, nu=nu)
    return (first,) + tuple(state[1:])


def restore(
    directory: str,
    mesh: jax.sharding.Mesh | MeshShape | str,
    *,
    step: int | None = None,
    optimizer: bool = True,
    config=None,
    indivisible: str = "error",
    **restore_kwargs,
) -> tuple[object, Restored]:
    """(model config, Restored) of `directory` (step: latest) on `mesh`.

    optimizer: restore the AdamW state too when the step has one. Other keyword arguments go to
    `CheckpointStore.restore` (global_batch_size, allow_batch_size_change, strict).
    """
    import models

    jmesh = mesh if isinstance(mesh, jax.sharding.Mesh) else mesh_from_shape(mesh)
    with CheckpointStore(directory) as store:
        state = store.trainer_state(step)
        cfg = config or models.config_from_dict(state["model_config"])
        shapes = models.param_shapes(cfg)
        p_shard = tree_shardings(shapes, models.logical_axes(cfg), jmesh, indivisible=indivisible)
        saved = store.params_metadata(step)
        step = state.get("step", step) if step is None else step
        target_opt = None
        if optimizer and os.path.isdir(os.path.join(str(store.directory), str(step), "opt_state")):
            o_shapes = jax.eval_shape(lambda p: adamw_state(p, p, p, 0), shapes)
            target_opt = abstract_tree(o_shapes, opt_state_shardings(o_shapes, p_shard, jmesh))
        restored = store.restore(
            step, target_params=abstract_tree(saved, p_shard), target_opt_state=target_opt, **restore_kwargs
        )
    return cfg, restored
