"""The Orbax checkpoint store: save on one mesh, restore on another, bit for bit; policies; errors.

The tree looks like a stacked-layer model (8 layers on a leading `layers` axis) with logical
axes; the optimizer state is optax.adamw after two real updates, so mu / nu are non-zero.
Meshes are named as on 8 devices and fitted to the devices present (`meshes.fit`): on one device
every mesh is dp=1 and a "reshard" restores onto the mesh it was saved on.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from meshes import cases, fit, fit_mesh, size

from hybridckpt.errors import CheckpointError
from hybridckpt.mesh import MeshShape, tree_shardings
from hybridckpt.plan import abstract_tree, optax_state_shardings
from hybridckpt.store import (
    CheckpointStore,
    latest_step,
    list_steps,
    load_params_metadata,
    read_trainer_state,
    rng_from_json,
    rng_to_json,
    save_checkpoint,
)

SHAPES = {
    "embed": {"embedding": (64, 32)},
    "layers": {"q": {"kernel": (8, 32, 32)}, "norm": {"scale": (8, 32)}},
}
AXES = {
    "embed": {"embedding": ("vocab", "embed")},
    "layers": {"q": {"kernel": ("layers", "embed", "heads")}, "norm": {"scale": ("layers", None)}},
}
TX = optax.adamw(1e-2, weight_decay=0.1)


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


PARAM_SDS = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), SHAPES, is_leaf=_is_shape)


@functools.cache
def host_values():
    """(params, opt_state) as numpy trees: random params, adamw after 2 updates."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), PARAM_SDS)
    state = TX.init(params)
    for _ in range(2):
        grads = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), PARAM_SDS)
        updates, state = TX.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    to_np = functools.partial(jax.tree.map, np.asarray)
    return to_np(params), to_np(state)


def shardings(mesh_text: str):
    mesh = fit_mesh(mesh_text)
    p_sh = tree_shardings(PARAM_SDS, AXES, mesh)
    o_sh = optax_state_shardings(jax.eval_shape(TX.init, PARAM_SDS), p_sh, mesh)
    return p_sh, o_sh


def on_mesh(mesh_text: str):
    """The host values placed on `mesh_text` as global jax.Arrays."""
    params, state = host_values()
    p_sh, o_sh = shardings(mesh_text)
    return jax.device_put(params, p_sh), jax.device_put(state, o_sh)


def targets(mesh_text: str):
    p_sh, o_sh = shardings(mesh_text)
    return (
        abstract_tree(PARAM_SDS, p_sh),
        abstract_tree(jax.eval_shape(TX.init, PARAM_SDS), o_sh),
    )


def assert_bitwise(got, want):
    g_flat, g_def = jax.tree_util.tree_flatten_with_path(got)
    w_flat, w_def = jax.tree_util.tree_flatten_with_path(want)
    assert g_def == w_def
    for (path, g), (_, w) in zip(g_flat, w_flat, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, jax.tree_util.keystr(path)
        assert g.tobytes() == w.tobytes(), jax.tree_util.keystr(path)


def assert_sharded_like(got, target):
    for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(target), strict=True):
        assert isinstance(g, jax.Array)
        assert g.sharding == t.sharding, (g.sharding, t.sharding)


def _sync_store(path, **kw):
    return CheckpointStore(path, async_save=False, **kw)


# ----------------------------------------------------------------------------- resharding


PAIRS = [
    ("fsdp=2,tp=2,pp=2", "dp=1,tp=1,pp=1"),  # 8 devices -> 1 device, pp changes
    ("dp=1", "fsdp=2,tp=2,pp=2"),  # 1 device -> 8 devices
    ("tp=4,pp=2", "fsdp=4,pp=2"),
    ("dp=2,fsdp=4", "tp=2,pp=4"),
    ("pp=8", "tp=8"),
    ("fsdp=8", "dp=2,tp=2,pp=2"),
]


@pytest.mark.parametrize("src,dst", cases(PAIRS))
def test_restore_onto_another_mesh_is_bitwise(tmp_path, src, dst):
    params, state = on_mesh(src)
    t_params, t_state = targets(dst)
    # the layout really changes: the big stacked kernel is placed differently on each side
    src_sh = {k: a.sharding for k, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    differ = [
        jax.tree_util.keystr(k)
        for (k, t) in jax.tree_util.tree_flatten_with_path(t_params)[0]
        if not src_sh[k].is_equivalent_to(t.sharding, len(t.shape))
    ]
    moved = MeshShape.parse(src) != MeshShape.parse(dst)  # all but on one device
    assert moved == ("['layers']['q']['kernel']" in differ) == (size(src) > 1 or size(dst) > 1)

    with _sync_store(tmp_path) as store:
        assert store.save(3, params, state, {"loss": 1.5, "global_batch_size": 16})
    with _sync_store(tmp_path) as store:
        out = store.restore(target_params=t_params, target_opt_state=t_state)

    want_params, want_state = host_values()
    assert out.step == 3
    assert_bitwise(out.params, want_params)
    assert_bitwise(out.opt_state, want_state)
    assert jax.tree.structure(out.opt_state) == jax.tree.structure(t_state)  # NamedTuples back
    assert np.abs(np.asarray(out.opt_state[0].mu["layers"]["q"]["kernel"])).max() > 0
    assert_sharded_like(out.params, t_params)
    assert_sharded_like(out.opt_state, t_state)
    assert out.topology.saved_mesh == MeshShape.parse(src)
    assert out.topology.target_mesh == MeshShape.parse(dst)
    assert out.topology.mesh_changed == moved


def test_params_only_restore_skips_saved_opt_state(tmp_path):
    params, state = on_mesh("fsdp=2,tp=2,pp=2")
    t_params, _ = targets("tp=8")
    with _sync_store(tmp_path) as store:
        store.save(1, params, state)
        assert "opt_state" in os.listdir(tmp_path / "1")
        out = store.restore(target_params=t_params)
    assert out.opt_state is None
    assert_bitwise(out.params, host_values()[0])
    assert_sharded_like(out.params, t_params)


# ----------------------------------------------------------------------------- policies


def test_save_interval(tmp_path):
    params, _ = on_mesh("fsdp=8")
    with _sync_store(tmp_path, save_interval_steps=3) as store:
        saved = [s for s in range(1, 11) if store.save(s, params)]
        assert saved == [3, 6, 9]
        assert store.save(10, params, force=True)
        assert store.steps() == [3, 6, 9, 10]
    assert list_steps(tmp_path) == [3, 6, 9, 10]
    assert latest_step(tmp_path) == 10


def test_max_to_keep(tmp_path):
    params, _ = on_mesh("fsdp=8")
    with _sync_store(tmp_path, max_to_keep=2) as store:
        for s in range(1, 6):
            store.save(s, params)
        assert store.steps() == [4, 5]
    assert sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit()) == [4, 5]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_by_loss_keeps_best_and_latest(tmp_path, mode):
    params, _ = on_mesh("fsdp=8")
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 3.0}
    with _sync_store(tmp_path, max_to_keep=2, keep_best_by="loss", best_mode=mode) as store:
        for s, loss in losses.items():
            state = {"loss": loss} if s % 2 else {"metrics": {"loss": loss}}
            store.save(s, params, trainer_state=state)
        ranked = sorted(losses, key=losses.get, reverse=mode == "max")
        assert store.steps() == sorted({*ranked[:2], 6})
        assert store.best_step() == ranked[0]
    assert list_steps(tmp_path) == sorted({*ranked[:2], 6})


def test_keep_best_needs_the_metric(tmp_path):
    params, _ = on_mesh("fsdp=8")
    with _sync_store(tmp_path, keep_best_by="loss") as store:
        with pytest.raises(CheckpointError, match="'loss'"):
            store.save(1, params, trainer_state={"lr": 0.1})


def test_async_save_and_wait(tmp_path):
    params, state = on_mesh("fsdp=2,tp=2,pp=2")
    store = CheckpointStore(tmp_path, async_save=True)
    assert store.save(7, params, state, {"lr": 3e-4})
    store.wait()
    assert (tmp_path / "7" / "commit_success.txt").exists()
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]
    store.close()
    t_params, t_state = targets("dp=2,tp=2,pp=2")
    with _sync_store(tmp_path) as reader:
        out = reader.restore(7, target_params=t_params, target_opt_state=t_state)
    assert_bitwise(out.params, host_values()[0])
    assert_bitwise(out.opt_state, host_values()[1])
    assert out.trainer_state["lr"] == 3e-4


@pytest.mark.parametrize("how", ["store_option", "no_opt_state"])
def test_save_without_optimizer(tmp_path, how):
    params, state = on_mesh("tp=4,pp=2")
    t_params, t_state = targets("fsdp=8")
    with _sync_store(tmp_path, save_optimizer=how != "store_option") as store:
        store.save(2, params, state if how == "store_option" else None)
        assert "opt_state" not in os.listdir(tmp_path / "2")
        with pytest.raises(CheckpointError, match="opt_state") as err:
            store.restore(target_params=t_params, target_opt_state=t_state)
        assert str(tmp_path) in str(err.value)
        out = store.restore(target_params=t_params)
    assert_bitwise(out.params, host_values()[0])


# ----------------------------------------------------------------------------- trainer state


def test_trainer_state_round_trip_and_rng(tmp_path):
    params, _ = on_mesh("fsdp=2,tp=2,pp=2")
    key = jax.random.key(1234)
    state = {
        "consumed_samples": 4096,
        "rng": key,
        "lr": 2.5e-4,
        "best_loss": 1.25,
        "model_config": {"family": "llama", "num_layers": 8, "rope_theta": 10000.0},
        "global_batch_size": 64,
        "my_extra": [1, "two"],
    }
    with _sync_store(tmp_path) as store:
        store.save(11, params, trainer_state=state)
    got = read_trainer_state(tmp_path)
    assert got["step"] == 11
    assert got["mesh"] == MeshShape.parse(fit("fsdp=2,tp=2,pp=2")).as_dict()  # 8 devices: fsdp=2,tp=2,pp=2
    for k in ("consumed_samples", "lr", "best_loss", "model_config", "global_batch_size"):
        assert got[k] == state[k]
    assert got["my_extra"] == [1, "two"]
    assert got["rng"] == rng_to_json(key)
    want_bits = np.asarray(jax.random.key_data(key))
    assert np.array_equal(np.asarray(rng_from_json(got["rng"])), want_bits)
    assert np.array_equal(
        np.asarray(jax.random.key_data(jax.random.wrap_key_data(rng_from_json(got["rng"])))),
        want_bits,
    )
    json.dumps(got)


def test_trainer_state_step_mismatch_and_non_json(tmp_path):
    params, _ = on_mesh("fsdp=8")
    with _sync_store(tmp_path) as store:
        with pytest.raises(CheckpointError, match="step"):
            store.save(5, params, trainer_state={"step": 4})
        with pytest.raises(CheckpointError, match="'bad'"):
            store.save(5, params, trainer_state={"bad": object()})
        assert store.save(5, params, trainer_state={"loss": jnp.float32(0.5)})
        assert store.trainer_state(5)["loss"] == 0.5
        with pytest.raises(CheckpointError, match="step 5 already exists"):
            store.save(5, params, force=True)


def test_topology_report(tmp_path):
    params, state = on_mesh("fsdp=2,tp=2,pp=2")
    with _sync_store(tmp_path) as store:
        store.save(1, params, state)
        moved = store.restore(target_params=targets("dp=1")[0]).topology
        same = store.restore(target_params=targets("fsdp=2,tp=2,pp=2")[0]).topology
    saved = MeshShape.parse(fit("fsdp=2,tp=2,pp=2"))  # on 8 devices: dp=1,fsdp=2,tp=2,pp=2
    n = saved.size
    where = f"{saved} ({n} device{'s' if n > 1 else ''})"
    assert (moved.saved_devices, moved.target_devices) == (n, 1)
    assert not same.changed and same.lines == (f"mesh unchanged: {where}",)
    if n == 1:  # one device: dp=1 onto dp=1 is no move
        assert not moved.changed and moved.lines == same.lines
        return
    assert moved.mesh_changed and moved.changed
    text = str(moved)
    assert where in text and "dp=1,fsdp=1,tp=1,pp=1 (1 device)" in text
    changed = [f"{a}: {v} -> 1" for a, v in saved.as_dict().items() if v > 1]  # fsdp, tp, pp on 8
    assert [line.strip() for line in moved.lines if " -> " in line] == changed


def test_global_batch_size_change_refused_then_allowed(tmp_path):
    params, _ = on_mesh("fsdp=8")
    t_params, _ = targets("tp=8")
    with _sync_store(tmp_path) as store:
        store.save(4, params, trainer_state={"global_batch_size": 32, "consumed_samples": 128})
        with pytest.raises(CheckpointError) as err:
            store.restore(target_params=t_params, global_batch_size=48)
        assert "32" in str(err.value) and "48" in str(err.value)
        assert str(tmp_path) in str(err.value)
        same = store.restore(target_params=t_params, global_batch_size=32)
        out = store.restore(
            target_params=t_params, global_batch_size=48, allow_batch_size_change=True
        )
    assert not same.topology.batch_size_changed
    assert out.topology.batch_size_changed
    assert any("32 -> 48" in line and "batch_index 2" in line for line in out.topology.lines)
    assert_bitwise(out.params, host_values()[0])


# ----------------------------------------------------------------------------- strictness


def test_missing_and_unexpected_keys_are_named(tmp_path):
    params, state = on_mesh("fsdp=2,tp=2,pp=2")
    t_params, t_state = targets("tp=8")
    fewer = {"embed": t_params["embed"], "layers": {"q": t_params["layers"]["q"]}}
    extra_leaf = jax.ShapeDtypeStruct(
        (8, 32, 32), jnp.float32, sharding=t_params["layers"]["q"]["kernel"].sharding
    )
    more = {**t_params, "layers": {**t_params["layers"], "k": {"kernel": extra_leaf}}}
    with _sync_store(tmp_path) as store:
        store.save(1, params, state)
        with pytest.raises(CheckpointError, match=r"not in the target: layers\.norm\.scale"):
            store.restore(target_params=fewer)
        with pytest.raises(
            CheckpointError, match=r"missing from the checkpoint: layers\.k\.kernel"
        ):
            store.restore(target_params=more)
        # opt_state keys are named the way Orbax names them: <index>.<field>.<param path>
        fewer_state = opt_target_without_norm()
        with pytest.raises(CheckpointError, match=r"0\.mu\.layers\.norm\.scale") as err:
            store.restore(target_params=t_params, target_opt_state=fewer_state)
        assert str(tmp_path) in str(err.value)

        loose = store.restore(target_params=more, strict=False)
        loose_fewer = store.restore(target_params=fewer, target_opt_state=fewer_state, strict=False)
    assert loose.missing_keys == ("params.layers.k.kernel",)
    assert isinstance(loose.params["layers"]["k"]["kernel"], jax.ShapeDtypeStruct)
    want_params, want_state = host_values()
    assert_bitwise(loose.params["layers"]["q"], want_params["layers"]["q"])
    assert_bitwise(loose.params["embed"], want_params["embed"])
    assert set(loose_fewer.unexpected_keys) == {
        "params.layers.norm.scale",
        "opt_state.0.mu.layers.norm.scale",
        "opt_state.0.nu.layers.norm.scale",
    }
    assert_bitwise(
        loose_fewer.params,
        {"embed": want_params["embed"], "layers": {"q": want_params["layers"]["q"]}},
    )
    assert_bitwise(loose_fewer.opt_state[0].mu["layers"]["q"], want_state[0].mu["layers"]["q"])
    assert_sharded_like(loose_fewer.params, fewer)


def opt_target_without_norm():
    """The tp=8 opt_state target without the norm leaves."""
    sub = {"embed": PARAM_SDS["embed"], "layers": {"q": PARAM_SDS["layers"]["q"]}}
    p_sh = tree_shardings(
        sub, {"embed": AXES["embed"], "layers": {"q": AXES["layers"]["q"]}}, fit_mesh("tp=8")
    )
    o_abs = jax.eval_shape(TX.init, sub)
    return abstract_tree(o_abs, optax_state_shardings(o_abs, p_sh, fit_mesh("tp=8")))


def test_shape_mismatch_is_named(tmp_path):
    params, _ = on_mesh("fsdp=8")
    t_params, _ = targets("fsdp=8")
    wrong = jax.tree.map(lambda x: x, t_params)
    wrong["layers"]["norm"]["scale"] = jax.ShapeDtypeStruct(
        (8, 16), jnp.float32, sharding=t_params["layers"]["norm"]["scale"].sharding
    )
    with _sync_store(tmp_path) as store:
        store.save(1, params)
        with pytest.raises(CheckpointError, match=r"layers\.norm\.scale.*\(8, 32\).*\(8, 16\)"):
            store.restore(target_params=wrong)


def test_missing_step_and_empty_directory_name_the_directory(tmp_path):
    params, _ = on_mesh("fsdp=8")
    t_params, _ = targets("fsdp=8")
    empty = tmp_path / "empty"
    with _sync_store(empty) as store:
        with pytest.raises(CheckpointError, match="no checkpoints") as err:
            store.restore(target_params=t_params)
        assert str(empty) in str(err.value)
    with _sync_store(tmp_path / "run") as store:
        store.save(2, params)
        with pytest.raises(CheckpointError, match=r"step 9.*\[2\]") as err:
            store.restore(9, target_params=t_params)
        assert str(tmp_path / "run") in str(err.value)
    with pytest.raises(CheckpointError) as err:
        read_trainer_state(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(err.value)
    assert list_steps(tmp_path / "nowhere") == [] and latest_step(tmp_path / "nowhere") is None


# ----------------------------------------------------------------------------- one-shot save


def test_save_checkpoint_is_atomic_and_restorable(tmp_path):
    params, state = on_mesh("tp=4,pp=2")
    dst = tmp_path / "imported"
    out = save_checkpoint(
        dst, 100, params, state, {"consumed_samples": 800, "global_batch_size": 8}
    )
    assert out == dst and os.listdir(tmp_path) == ["imported"]  # no temporary sibling remains
    assert list_steps(dst) == [100]
    assert read_trainer_state(dst, 100)["mesh"] == MeshShape.parse(fit("tp=4,pp=2")).as_dict()

    meta = load_params_metadata(dst, 100)
    assert jax.tree.structure(meta) == jax.tree.structure(PARAM_SDS)
    for m, s in zip(jax.tree.leaves(meta), jax.tree.leaves(PARAM_SDS), strict=True):
        assert (m.shape, m.dtype) == (s.shape, s.dtype)
    t_params = abstract_tree(meta, tree_shardings(meta, AXES, fit_mesh("fsdp=4,pp=2")))
    _, t_state = targets("fsdp=4,pp=2")
    with _sync_store(dst) as store:
        got = store.restore(target_params=t_params, target_opt_state=t_state)
    assert_bitwise(got.params, host_values()[0])
    assert_bitwise(got.opt_state, host_values()[1])

    # a non-empty destination is refused and left untouched
    before = sorted(os.listdir(dst))
    with pytest.raises(CheckpointError, match="not empty") as err:
        save_checkpoint(dst, 200, params)
    assert str(dst) in str(err.value)
    assert sorted(os.listdir(dst)) == before and list_steps(dst) == [100]

    # overwrite replaces it by rename; nothing else is left beside it
    doubled = jax.tree.map(lambda a: a * 2, params)
    save_checkpoint(dst, 200, doubled, overwrite=True)
    assert os.listdir(tmp_path) == ["imported"] and list_steps(dst) == [200]
    with _sync_store(dst) as store:
        got = store.restore(target_params=targets("dp=1")[0])
    assert_bitwise(got.params, jax.tree.map(lambda a: a * 2, host_values()[0]))


def test_save_checkpoint_failure_leaves_nothing(tmp_path):
    params, _ = on_mesh("fsdp=8")
    (tmp_path / "empty_dst").mkdir()
    with pytest.raises(CheckpointError, match="not JSON"):
        save_checkpoint(tmp_path / "empty_dst", 1, params, trainer_state={"x": object()})
    assert os.listdir(tmp_path) == ["empty_dst"] and os.listdir(tmp_path / "empty_dst") == []
    save_checkpoint(tmp_path / "empty_dst", 1, params)  # an empty destination is fine
    assert list_steps(tmp_path / "empty_dst") == [1] and os.listdir(tmp_path) == ["empty_dst"]


def test_abstract_tree_dtype_override_keeps_integer_leaves():
    _, o_sh = shardings("fsdp=8")
    o_abs = jax.eval_shape(TX.init, PARAM_SDS)
    bf16 = abstract_tree(o_abs, o_sh, dtype=jnp.bfloat16)
    assert bf16[0].count.dtype == jnp.int32
    assert bf16[0].mu["embed"]["embedding"].dtype == jnp.bfloat16
    assert bf16[0].mu["embed"]["embedding"].sharding == o_sh[0].mu["embed"]["embedding"]
