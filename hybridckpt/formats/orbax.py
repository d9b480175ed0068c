"""hybridckpt's own Orbax checkpoints as a source (for export, verify and logits).

Layout: see `hybridckpt.checkpoint` (`DIR/<step>/{params,opt_state,trainer_state}`); the model
config is `trainer_state["model_config"]`. Params are restored onto one device and named by the
inverse of the model rules.
"""

from __future__ import annotations

import os

import numpy as np

from hybridckpt import convert
from hybridckpt.errors import CheckpointError, ConfigError
from hybridckpt.lazy import ArrayTensor

NAME = "orbax"


def _root_and_step(path: str) -> tuple[str, int | None]:
    """`DIR` or `DIR/<step>` -> (DIR, step or None)."""
    base = os.path.basename(os.path.normpath(path))
    if base.isdigit() and os.path.isdir(os.path.join(path, "params")):
        return os.path.dirname(os.path.normpath(path)), int(base)
    return path, None


def detect(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    root, step = _root_and_step(path)
    if step is not None:
        return True
    return any(
        d.isdigit() and os.path.isdir(os.path.join(path, d, "params")) for d in os.listdir(path)
    )


def _config(root: str, step: int | None, config):
    import models
    from hybridckpt.checkpoint import read_trainer_state

    state = read_trainer_state(root, step)
    if config is not None:
        return config, state
    if "model_config" not in state:
        raise ConfigError(f"{root}: trainer_state has no model_config; pass --config")
    return models.config_from_dict(state["model_config"]), state


def restore_host(path: str, *, step: int | None = None, config=None):
    """(config, trainer_state, params, opt_state or None) restored onto one device."""
    import jax

    import models
    from hybridckpt.checkpoint import CheckpointStore, abstract_tree
    from hybridckpt.mesh import make_mesh, opt_state_shardings, tree_shardings
    from hybridckpt.restore import adamw_state

    root, dir_step = _root_and_step(path)
    step = dir_step if step is None else step
    cfg, state = _config(root, step, config)
    mesh = make_mesh(devices=jax.devices()[:1])
    shapes = models.param_shapes(cfg)
    p_shard = tree_shardings(shapes, models.logical_axes(cfg), mesh)
    store = CheckpointStore(root)
    try:
        step = store.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{root}: no checkpoint steps")
        # restore in the dtype it was saved in (bf16 weights stay bf16)
        saved = store.params_metadata(step)
        target = abstract_tree(saved, p_shard)
        has_opt = os.path.isdir(os.path.join(root, str(step), "opt_state"))
        target_opt = None
        if has_opt:
            opt_shapes = jax.eval_shape(lambda p: adamw_state(p, p, p, 0), shapes)
            target_opt = abstract_tree(opt_shapes, opt_state_shardings(opt_shapes, p_shard, mesh))
        restored = store.restore(step, target_params=target, target_opt_state=target_opt)
    finally:
        store.close()
    return cfg, state, restored.params, restored.opt_state


def open_hf(path: str, *, step: int | None = None, config=None):
    """Restore params (and the Adam moments when saved) onto one device, under HF names."""
    from hybridckpt.pipeline import Opened

    cfg, state, params_tree, opt_state = restore_host(path, step=step, config=config)
    inv = convert.model_rules(cfg).invert()

    def named(tree):
        flat = {k: ArrayTensor(np.asarray(v)) for k, v in convert.flatten(tree).items()}
        return flat

    params = named(params_tree)
    exp_avg = exp_avg_sq = None
    opt_step = state.get("step", step)
    if opt_state is not None:
        adam = opt_state[0]
        exp_avg, exp_avg_sq = named(adam.mu), named(adam.nu)
        opt_step = int(np.asarray(adam.count))
    hf = convert.Named(
        inv.apply_unstack(params).tensors,
        inv.apply_unstack(exp_avg).tensors if exp_avg else None,
        inv.apply_unstack(exp_avg_sq).tensors if exp_avg_sq else None,
        opt_step,
    )
    return Opened(NAME, path, cfg, hf, state, dict(state.get("mesh", {})))


def inspect(path: str) -> dict:
    from hybridckpt.checkpoint import list_steps, load_params_metadata

    root, step = _root_and_step(path)
    steps = list_steps(root)
    step = step if step is not None else (steps[-1] if steps else None)
    cfg, state = _config(root, step, None)
    meta = convert.flatten(load_params_metadata(root, step))
    return {
        "format": NAME,
        "path": path,
        "steps": steps,
        "step": step,
        "topology": state.get("mesh", {}),
        "config": state.get("model_config"),
        "needs_config": False,
        "tensors": [
            {"name": k, "shape": list(v.shape), "dtype": str(v.dtype), "pieces": 1} for k, v in meta.items()
        ],
        "optimizer": {"saved": os.path.isdir(os.path.join(root, str(step), "opt_state"))},
        "notes": [],
        "trainer_state": state,
    }
