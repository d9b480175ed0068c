"""The suite's own device machinery: `meshes.fit` (meshes that fit the devices present), the
`multidevice` scan (tests/multidevice.py) and the `MeshGuard` of tests/conftest.py, each shown
to fail where it must: a mesh bigger than the devices is refused with a message naming both
counts, and an unmarked test that builds a mesh of several devices fails naming the test.

These run the same on 1, 2, 4 or 8 devices: `fit` is checked for every count at once (its
`devices` argument), the scan reads source text, and the guard is shown on the largest mesh the
devices allow (on one device, where no multi-device mesh can exist, on a mesh of 2 stand-in
devices: the guard reads only `mesh.devices.size`).
"""

from __future__ import annotations

import types

import conftest
import jax
import multidevice
import numpy as np
import pytest
from meshes import cases, device_count, fit, fit_pair, size, spec

import hybridckpt.mesh as mesh_module
from hybridckpt.errors import MeshError
from hybridckpt.mesh import MeshShape, mesh_from_shape

# every mesh as text that the suite's tests name (their 8-device forms)
SUITE_MESHES = (
    "tp=4,pp=2", "fsdp=2,tp=2,pp=2", "dp=2,fsdp=4", "dp=2,tp=4", "fsdp=8", "tp=8", "dp=4,pp=2",
    "dp=2,fsdp=2,tp=2", "dp=2,tp=2,pp=2", "fsdp=2,tp=4", "fsdp=2,pp=2", "dp=2,tp=2", "fsdp=2,tp=2",
    "pp=2,tp=4", "tp=4", "tp=2", "fsdp=2", "dp=1",
)


@pytest.mark.parametrize(
    "devices, want",
    [
        (8, ("tp=4,pp=2", "fsdp=2,tp=2,pp=2", "dp=2,fsdp=4")),
        (4, ("tp=2,pp=2", "tp=2,pp=2", "dp=2,fsdp=2")),
        (2, ("tp=2", "tp=2", "fsdp=2")),
        (1, ("dp=1", "dp=1", "dp=1")),
    ],
)
def test_fit_is_the_table_of_its_docstring(devices, want):
    got = tuple(fit(m, devices) for m in ("tp=4,pp=2", "fsdp=2,tp=2,pp=2", "dp=2,fsdp=4"))
    assert got == want


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 5, 6, 7, 8])
def test_fit_fits_keeps_the_form_and_fit_pair_reshards(devices):
    """For every mesh of the suite and every device count: the fitted mesh fits, each axis
    divides the axis it came from (what divided the tensors still does), the mesh is unchanged
    where it fits, and a reshard (`fit_pair`) stays one wherever there are 2 devices."""
    for m in SUITE_MESHES:
        got = MeshShape.parse(fit(m, devices)).as_dict()
        meant = MeshShape.parse(m).as_dict()
        assert MeshShape(**got).size <= devices, (m, devices, got)
        assert all(meant[a] % got[a] == 0 for a in meant), (m, got)
        if size(m) <= devices:
            assert fit(m, devices) == m
    for a, b in [("fsdp=2,tp=2,pp=2", "dp=2,tp=4"), ("tp=4,pp=2", "fsdp=8"), ("dp=2,tp=2", "fsdp=2,tp=2"),
                 ("fsdp=2,tp=2,pp=2", "tp=4")]:
        fa, fb = fit_pair(a, b, devices)
        assert size(fa) <= devices and size(fb) <= devices
        assert (MeshShape.parse(fa) != MeshShape.parse(fb)) == (devices >= 2), (a, b, devices, fa, fb)
    # an axis asked to be kept (the expert axis of MoE weights) survives where it can
    assert MeshShape.parse(fit("dp=2,fsdp=2,tp=2", min(devices, 4), keep="dp")).dp == (2 if devices >= 2 else 1)


def test_cases_fits_the_parametrize_values_and_drops_repeats():
    values = cases(["tp=4,pp=2", "tp=4", ("x", "fsdp=2,tp=2,pp=2", "dp=2,tp=4"), ("y", 3)])
    n = device_count()
    assert values[0] == fit("tp=4,pp=2")
    assert all(size(m) <= n for v in values for m in (v if isinstance(v, tuple) else (v,)) if isinstance(m, str)
               and "=" in m)
    assert ("y", 3) in values and len(values) == len(set(values))


def test_spec_names_only_the_axes_of_size_above_one():
    assert spec("tp=2", "pp", "fsdp", "tp") == jax.sharding.PartitionSpec(None, None, "tp")
    assert spec("fsdp=2,tp=2,pp=2", "pp", ("dp", "fsdp"), "tp") == jax.sharding.PartitionSpec("pp", "fsdp", "tp")


def test_a_mesh_bigger_than_the_devices_is_refused_and_fit_is_what_avoids_it():
    """What `fit` protects the tests from: the 8-device mesh itself on fewer devices is refused
    with a message naming both counts (one more device than present, whatever the count); its
    fit builds and uses every device it names. On 8 devices the same check runs on 9."""
    n = device_count()
    too_big = "dp=2,tp=4" if n < 8 else f"dp={n + 1}"
    with pytest.raises(MeshError, match=rf"needs {size(too_big)} devices but only {n} exist"):
        mesh_from_shape(too_big)
    fitted = mesh_from_shape(fit("dp=2,tp=4"))
    assert fitted.devices.size == min(n, 8) if n in (1, 2, 4, 8) else fitted.devices.size <= n
    with pytest.raises(MeshError, match="bad mesh"):
        fit("tq=2")


SOURCE = '''
import pytest
from meshes import fit, abstract_mesh
from hybridckpt.mesh import mesh_from_shape

MESH = "fsdp=2,tp=2"

def helper():
    return fit("tp=4")

def test_literal():
    run("tp=2")

def test_dp1_only():
    run("dp=1")

def test_rule_only():
    assert abstract_mesh("fsdp=2,tp=2,pp=2")

def test_through_a_helper():
    helper()

def test_through_a_constant():
    run(MESH)

def test_plain():
    assert 1 + 1 == 2

def test_uses_fixture(imported):
    pass

def test_attacks_cases_is_not_ours():
    attacks.cases()
'''

CONFTEST = '''
import pytest
from hybridckpt.mesh import mesh_from_shape

@pytest.fixture
def imported():
    return mesh_from_shape("tp=2")
'''


def test_the_scan_marks_what_builds_meshes_and_nothing_else(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    sub = tmp_path / "sub"
    sub.mkdir()
    path = sub / "test_x.py"
    path.write_text(SOURCE)
    multidevice.mesh_names.cache_clear()
    try:
        marked = {
            name for name in ("test_literal", "test_dp1_only", "test_rule_only", "test_through_a_helper",
                              "test_through_a_constant", "test_plain", "test_uses_fixture",
                              "test_attacks_cases_is_not_ours")
            if multidevice.is_multidevice(str(path), name, ("imported",) if name == "test_uses_fixture" else (),
                                          str(tmp_path))
        }  # fmt: skip
    finally:
        multidevice.mesh_names.cache_clear()
    assert marked == {"test_literal", "test_through_a_helper", "test_through_a_constant", "test_uses_fixture"}


def test_this_files_mesh_tests_are_marked(request):
    """The conftest marked the tests of this file that build meshes (and only them)."""
    items = {i.originalname: bool(i.get_closest_marker("multidevice")) for i in request.session.items
             if i.path == request.node.path}  # fmt: skip
    assert items["test_a_mesh_bigger_than_the_devices_is_refused_and_fit_is_what_avoids_it"]
    assert not items["test_spec_names_only_the_axes_of_size_above_one"]


def test_the_guard_fails_an_unmarked_test_that_builds_a_multidevice_mesh(monkeypatch):
    """Inside `MeshGuard` (what tests/conftest.py wraps around every unmarked test), a mesh of
    several devices built through `hybridckpt.mesh.make_mesh` fails, naming the test and the
    marker; a one-device mesh passes; leaving the guard restores `make_mesh`. With 2 or more
    devices the mesh is a real one of 2; on one device, where none can exist, `make_mesh` is a
    stand-in returning 2 devices (the guard reads only `mesh.devices.size`)."""
    item = types.SimpleNamespace(nodeid="tests/test_x.py::test_y")
    if device_count() == 1:
        real = mesh_module.make_mesh
        stand_in = types.SimpleNamespace(devices=np.empty((2,), dtype=object))
        monkeypatch.setattr(mesh_module, "make_mesh", lambda *a, **k: stand_in if k.get("tp") == 2 else real(*a, **k))
    before = mesh_module.make_mesh
    with conftest.MeshGuard(item):
        assert mesh_module.make_mesh is not before
        with pytest.raises(AssertionError, match=r"^tests/test_x.py::test_y builds a mesh of 2 devices .*multidevice"):
            mesh_module.make_mesh(tp=2, devices=jax.devices()[:2])
        if device_count() > 1:  # through what the jobs, the CLI and the tests call
            with pytest.raises(AssertionError, match="builds a mesh of 2 devices"):
                mesh_from_shape("tp=2")
        assert mesh_from_shape("dp=1").devices.size == 1
    assert mesh_module.make_mesh is before
    if device_count() > 1:
        assert mesh_from_shape("tp=2").devices.size == 2  # outside the guard: allowed


def test_the_rerun_files_exist_and_build_meshes():
    """Each file the README's command reruns on 4 and 2 devices (`multidevice.RERUN`) is there
    and has multi-device tests (a renamed or emptied file would leave the rerun checking less)."""
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    assert len(multidevice.RERUN) == len(set(multidevice.RERUN)) >= 10
    for rel in multidevice.RERUN:
        path = os.path.join(tests, rel)
        assert os.path.isfile(path), rel
        assert any(n.startswith("test_") for n in multidevice.mesh_names(path, tests)), rel
        assert multidevice.is_rerun(path, tests)
    assert not multidevice.is_rerun(os.path.join(tests, "formats", "test_dcp.py"), tests)
