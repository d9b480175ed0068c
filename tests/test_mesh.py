"""Meshes, logical-axis rules and the shardings of params and optimizer state."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P
from meshes import abstract_mesh, device_count, fit

from hybridckpt.errors import MeshError
from hybridckpt.mesh import (
    MeshShape,
    batch_sharding,
    make_mesh,
    mesh_from_shape,
    partition_spec,
    tree_shardings,
)
from hybridckpt.plan import optax_state_shardings


def test_make_mesh_axes_and_device_count():
    """On the devices present (8: dp=2,tp=2,pp=2; tp=4: the first 4 of 8; 16 of 8 refused)."""
    n = device_count()
    shape = MeshShape.parse(fit("dp=2,tp=2,pp=2"))
    m = make_mesh(**shape.as_dict(), devices=jax.devices()[: shape.size])
    assert m.axis_names == ("dp", "fsdp", "tp", "pp")
    assert dict(m.shape) == shape.as_dict()
    if n == 8:
        assert dict(m.shape) == {"dp": 2, "fsdp": 1, "tp": 2, "pp": 2}
    half = max(1, n // 2)  # the first N devices, as the CLI and the jobs take them (issue 37)
    assert list(make_mesh(tp=half).devices.flat) == jax.devices()[:half]
    with pytest.raises(MeshError, match=f"needs {2 * n} devices but only {n} exist"):
        make_mesh(tp=2 * n)
    with pytest.raises(MeshError, match=f"needs {n + 1} devices but only {n} are given"):
        make_mesh(dp=n + 1, devices=jax.devices())
    assert make_mesh(tp=half, devices=jax.devices()[:half]).devices.size == half
    assert mesh_from_shape(f"tp={half}").devices.size == half
    with pytest.raises(MeshError, match=f"needs {2 * n} devices but only {n}"):
        mesh_from_shape(f"dp=2,tp={n}")


def test_mesh_shape_parse():
    assert MeshShape.parse("dp=1,fsdp=2,tp=2,pp=2") == MeshShape(1, 2, 2, 2)
    assert str(MeshShape.parse("tp=4")) == "dp=1,fsdp=1,tp=4,pp=1"
    for bad in ("xp=2", "tp=0", "tp=two"):
        with pytest.raises(MeshError, match="bad mesh"):
            MeshShape.parse(bad)


# the rules alone: meshes without devices (`abstract_mesh`), the same specs on any device count


def test_logical_rules_map_to_mesh_axes():
    m = abstract_mesh("fsdp=2,tp=2,pp=2")
    assert partition_spec("w", (4, 8, 6), ("layers", "embed", "heads"), m) == P("pp", "fsdp", "tp")
    assert partition_spec("e", (8, 4), ("vocab", "embed"), m) == P("tp", "fsdp")
    assert partition_spec("n", (4, 8), ("layers", None), m) == P("pp", None)
    # an axis of size 1 is not named
    m1 = abstract_mesh("tp=8")
    assert partition_spec("w", (4, 8, 16), ("layers", "embed", "heads"), m1) == P(None, None, "tp")
    assert batch_sharding(abstract_mesh("dp=2,fsdp=4")).spec == P(("dp", "fsdp"), None)


def test_indivisible_dimension_error_or_replicate():
    m = abstract_mesh("tp=8")
    with pytest.raises(MeshError, match=r"lm_head: dim 1 \(vocab\) has size 50257.*size 8 cannot divide"):
        partition_spec("lm_head", (64, 50257), ("embed", "vocab"), m)
    assert partition_spec("lm_head", (64, 50257), ("embed", "vocab"), m, indivisible="replicate") == P(None, None)


def test_optimizer_state_sharded_like_params_counters_replicated():
    m = abstract_mesh("fsdp=2,tp=2,pp=2")
    params = {"a": jnp.zeros((4, 8)), "b": {"c": jnp.zeros((2, 8))}}
    axes = {"a": ("embed", "mlp"), "b": {"c": ("layers", "embed")}}
    ps = tree_shardings(params, axes, m)
    st = jax.eval_shape(optax.adamw(1e-3).init, params)
    os_ = optax_state_shardings(st, ps, m)
    adam = os_[0]
    assert adam.mu == ps and adam.nu == ps
    assert adam.count.spec == P()
