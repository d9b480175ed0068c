"""Meshes that fit the devices present: the same tests run on 1, 2, 4 or 8 devices.

A test names the mesh it means on 8 devices (`"tp=4,pp=2"`) and asks for `fit("tp=4,pp=2")`:
that mesh itself where it fits, else the biggest mesh of the same form that does. "Of the same
form": each axis keeps a divisor of its size (axes only shrink, so whatever divided the tensors
still divides them); among the meshes that fit, the one with the most devices, then the most
axes of size > 1 (so a tp x pp test keeps both axes as long as it can), then the larger tp, pp,
fsdp, dp in that order (tp and pp split tensors and layers; dp only replicates). On 8 devices
every mesh of the suite fits and `fit` returns its argument unchanged.

    devices   fit("tp=4,pp=2")   fit("fsdp=2,tp=2,pp=2")   fit("dp=2,fsdp=4")
    8         tp=4,pp=2          fsdp=2,tp=2,pp=2          dp=2,fsdp=4
    4         tp=2,pp=2          tp=2,pp=2                 dp=2,fsdp=2
    2         tp=2               tp=2                      fsdp=2
    1         dp=1               dp=1                      dp=1

`fit_pair(a, b)` fits a reshard (import onto `a`, restore onto `b`): `b` becomes the biggest
mesh of its form that fits and differs from fitted `a` where one exists, so a reshard stays a
reshard down to 2 devices (on 1 device both are `dp=1`: the test then checks the same path with
the layout unchanged).

The device count is `jax.device_count()`: 8 simulated CPU devices unless
`$HYBRIDCKPT_TEST_DEVICES` says otherwise; on GPUs, the GPUs present (tests/conftest.py).
Tests that use meshes get the `multidevice` marker (tests/conftest.py), to rerun them on 4, 2
and 1 devices (docs/testing.md); the README's test command reruns a part of them on 4 and 2.
"""

from __future__ import annotations

import itertools
import re

import jax
from jax.sharding import AbstractMesh, PartitionSpec

from hybridckpt.mesh import MESH_AXES, MeshShape, mesh_from_shape

_PREFERENCE = ("tp", "pp", "fsdp", "dp")  # which axis to keep when two fits use as many devices
_MESH_TEXT = re.compile(r"(?:dp|fsdp|tp|pp)=\d+(?:,(?:dp|fsdp|tp|pp)=\d+)*")


def device_count() -> int:
    """The devices the tests run on (all devices of this process)."""
    return jax.device_count()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _text(shape: MeshShape) -> str:
    sizes = shape.as_dict()
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if sizes[a] > 1) or "dp=1"


def _fits(mesh: str, devices: int, keep: tuple[str, ...] = ()) -> list[MeshShape]:
    """Every mesh of `mesh`'s form on at most `devices` devices, best first (module docstring);
    the axes in `keep` are kept (> 1) before any other consideration but the device count."""
    sizes = MeshShape.parse(mesh).as_dict()
    shapes = [
        MeshShape(**dict(zip(MESH_AXES, combo, strict=True)))
        for combo in itertools.product(*(_divisors(sizes[a]) for a in MESH_AXES))
    ]
    shapes = [s for s in shapes if s.size <= devices]

    def rank(s: MeshShape):
        d = s.as_dict()
        kept = tuple(d[a] > 1 for a in keep)
        return (s.size, kept, sum(v > 1 for v in d.values()), *(d[a] for a in _PREFERENCE))

    return sorted(shapes, key=rank, reverse=True)


def _keep(keep: str | tuple[str, ...]) -> tuple[str, ...]:
    return (keep,) if isinstance(keep, str) else tuple(keep)


def fit(mesh: str, devices: int | None = None, *, keep: str | tuple[str, ...] = ()) -> str:
    """`mesh` ("tp=4,pp=2") if it fits `devices` (default: the devices present), else the biggest
    mesh of its form that does, as text ("tp=2,pp=2"). `keep`: axes that matter most to the
    test (e.g. "dp", the expert axis of MoE weights), kept > 1 where the device count allows."""
    n = device_count() if devices is None else devices
    if MeshShape.parse(mesh).size <= n:
        return mesh
    return _text(_fits(mesh, n, _keep(keep))[0])


def fit_pair(
    mesh_a: str, mesh_b: str, devices: int | None = None, *, keep: str | tuple[str, ...] = ()
) -> tuple[str, str]:
    """(fit(mesh_a), fit(mesh_b)), made to differ where the device count allows: the one of the
    two replaced by its best fit that differs from the other is the one that keeps more devices
    (mesh_b on a tie)."""
    n = device_count() if devices is None else devices
    keep = _keep(keep)
    a, b = fit(mesh_a, n, keep=keep), fit(mesh_b, n, keep=keep)
    if MeshShape.parse(a) != MeshShape.parse(b):
        return a, b
    other_b = [s for s in _fits(mesh_b, n, keep) if s != MeshShape.parse(a)]
    other_a = [s for s in _fits(mesh_a, n, keep) if s != MeshShape.parse(b)]
    if other_a and (not other_b or other_a[0].size > other_b[0].size):
        return _text(other_a[0]), b
    return a, _text(other_b[0]) if other_b else b


def is_mesh(value) -> bool:
    """Whether `value` is a mesh as text ("tp=2", "fsdp=2,tp=2,pp=2")."""
    return isinstance(value, str) and _MESH_TEXT.fullmatch(value) is not None


def cases(values, *, keep: str | tuple[str, ...] = ()) -> list:
    """pytest.mark.parametrize values with their meshes fitted: a mesh -> `fit`; in a tuple, two
    meshes -> `fit_pair` (a reshard), more -> `fit` each. Values that become equal are listed
    once (on fewer devices two meshes of a list can fit to the same mesh: the same test twice)."""
    out = []
    for value in values:
        if is_mesh(value):
            value = fit(value, keep=keep)
        elif isinstance(value, tuple):
            where = [i for i, v in enumerate(value) if is_mesh(v)]
            fitted = (fit_pair(*(value[i] for i in where), keep=keep) if len(where) == 2
                      else [fit(value[i], keep=keep) for i in where])
            value = list(value)
            for i, m in zip(where, fitted, strict=True):
                value[i] = m
            value = tuple(value)
        if value not in out:
            out.append(value)
    return out


def fit_mesh(mesh: str, devices: int | None = None):
    """The jax Mesh of `fit(mesh)`, on the first devices."""
    return mesh_from_shape(fit(mesh, devices))


def size(mesh: str) -> int:
    """The device count of a mesh given as text."""
    return MeshShape.parse(mesh).size


def spec(mesh, *entries) -> PartitionSpec:
    """PartitionSpec(*entries) as hybridckpt.mesh names it on `mesh` (text or a Mesh): mesh axes
    of size 1 are not named, so P("pp", "fsdp", "tp") on "tp=2" is P(None, None, "tp")."""
    sizes = MeshShape.parse(mesh).as_dict() if isinstance(mesh, str) else dict(mesh.shape)
    out = []
    for entry in entries:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def abstract_mesh(mesh: str) -> AbstractMesh:
    """The mesh `mesh` ("fsdp=2,tp=2,pp=2") as shapes alone, without devices: for tests of the
    sharding rules (PartitionSpecs, plans), which then check the same specs on any device count."""
    sizes = MeshShape.parse(mesh).as_dict()
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
