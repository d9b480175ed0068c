"""The whole path for any source format: import -> Orbax on mesh A -> restore on mesh B -> export.

`roundtrip` returns the exported single-card HF tensors (and moments) so each format's tests can
compare them with their own reference, bit for bit.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from meshes import device_count, fit_pair

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source
from hybridckpt.jobs.restore import restore
from hybridckpt.mesh import mesh_from_shape, tree_shardings


def roundtrip(src: str, workdir, *, mesh_a: str, mesh_b: str, config: str | None = None, optimizer: bool = True,
              keep: str | tuple[str, ...] = ()):
    """(params, exp_avg, exp_avg_sq, step) of the export, as numpy dicts under HF names.

    `mesh_a`, `mesh_b`: the meshes meant on 8 devices, fitted to the devices present
    (`meshes.fit_pair`, keeping the axes `keep` first: a reshard stays one down to 2 devices; on
    1 both are dp=1)."""
    mesh_a, mesh_b = fit_pair(mesh_a, mesh_b, keep=keep)
    ckpt, out = os.path.join(workdir, "orbax"), os.path.join(workdir, "exported")
    s = jobs.import_checkpoint(src, ckpt, mesh=mesh_a, config=config)
    assert s.with_optimizer == optimizer
    _, r = restore(ckpt, mesh_b, optimizer=optimizer)
    assert (r.opt_state is not None) == optimizer
    cfg = jobs.open_checkpoint(ckpt).config
    mesh = mesh_from_shape(mesh_b)
    shapes = models.param_shapes(cfg)
    p_shard = tree_shardings(shapes, models.logical_axes(cfg), mesh)
    a_shard = tree_shardings(shapes, models.logical_axes(cfg), mesh_from_shape(mesh_a))
    if device_count() > 1:
        assert jax.tree.leaves(p_shard) != jax.tree.leaves(a_shard)  # a real reshard
    leaf = r.params["layers"][next(iter(r.params["layers"]))]
    leaf = leaf["kernel"] if isinstance(leaf, dict) and "kernel" in leaf else jax.tree.leaves(leaf)[0]
    assert leaf.sharding.mesh.shape == mesh.shape
    jobs.export_checkpoint(ckpt, out, optimizer=optimizer)
    exported = open_source(out)
    params = {k: v.materialize() for k, v in exported.tensors.items()}
    # what mesh B holds is what was exported, bit for bit
    assert_same({k: v.materialize() for k, v in _hf(r.params, cfg).items()}, params, "mesh B params")
    if not optimizer:
        return params, None, None, exported.step
    opt = exported.optimizer
    mu = {k: v.materialize() for k, v in opt.slots["exp_avg"].items()}
    nu = {k: v.materialize() for k, v in opt.slots["exp_avg_sq"].items()}
    adam = r.opt_state[0]
    assert_same({k: v.materialize() for k, v in _hf(adam.mu, cfg).items()}, mu, "mesh B exp_avg")
    assert_same({k: v.materialize() for k, v in _hf(adam.nu, cfg).items()}, nu, "mesh B exp_avg_sq")
    assert int(adam.count) == opt.step
    return params, mu, nu, opt.step


def _hf(tree, cfg):
    return naming.tree_to_hf(jax.tree.map(np.asarray, tree), cfg)


def assert_same(got: dict, want: dict, what: str = "params") -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:5])
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, w.dtype, g.shape, w.shape)
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), (what, k)


def optax_init(tx, params):
    """`tx.init(params)` as one jitted program (its zeros compiled once, not once per leaf shape
    and sharding by eager dispatch)."""
    return jax.jit(tx.init)(params)


def optax_step(tx, grads, state, params):
    """The params after one step of `tx` (`optax.apply_updates(params, tx.update(grads, state,
    params)[0])`), computed as one jitted program: the same optax code, traced once and compiled
    once, where eager dispatch compiles each of its elementwise ops for every leaf shape and
    sharding it meets (about 130 small compilations for a 21-leaf Llama, ~0.9 CPU-s, against one
    of ~0.1 CPU-s). Float results may differ from eager ones in their last bits (XLA fuses the
    ops); every caller compares with a tolerance."""
    import optax

    return jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0]))(grads, state, params)
