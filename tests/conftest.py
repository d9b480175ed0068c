"""Test session set-up: the devices (8 simulated CPU devices unless told otherwise) before jax
initialises; the same tests run on 1, 2, 4 or 8 devices, CPU or GPU.

Devices: `$HYBRIDCKPT_TEST_PLATFORM` (default `cpu`; `cuda` for GPUs) becomes `JAX_PLATFORMS`.
On CPU, `$HYBRIDCKPT_TEST_DEVICES` simulated devices (default 8; an
`--xla_force_host_platform_device_count` already in `$XLA_FLAGS` is kept unless the variable is
set). On GPUs, the GPUs present, or the first `$HYBRIDCKPT_TEST_DEVICES` of them
(`CUDA_VISIBLE_DEVICES`, unless that is set already), with memory allocated on demand: several
processes share the GPUs (pytest-xdist workers, the CLI and multi-process tests' children). A
count that is asked for is checked once jax is up.

Meshes: tests build them with `tests/meshes.py` (`fit("tp=4,pp=2")`: that mesh where it fits,
else the biggest of its form that does). Every test that builds a mesh of several devices gets
the `multidevice` marker here (`tests/multidevice.py` finds them in the source: mesh literals,
the mesh helpers, and what refers to them); `HYBRIDCKPT_TEST_DEVICES=4 python -m pytest -m
multidevice tests` runs them again on 4 devices (docs/testing.md: the full check at 4, 2 and 1),
where a new test that only works on 8 devices fails without its author marking anything. The
README's test command reruns a representative part of them (`multidevice_rerun`:
`multidevice.RERUN`) on 4 and 2 devices. An unmarked test that builds such a mesh anyway fails
(`MeshGuard`), so the scan cannot miss one silently.

The tests are laid out like the code: `lazy/`, `rules/`, `io/` (`containers/pickle/`), `optim/`,
`formats/` (one file per format, plus damaged files), `store/` (our Orbax checkpoints: manager,
streaming save, restore, checksums, crash safety), `jobs/` (the CLI and the jobs end to end),
`families/` (the model families of `models/`; a folder named `models` here would shadow that
package for `import models`), and at this level what cuts across layers (import layers, README,
hostile pickles, fuzzing, meshes and the plan). Helpers: `e2e.py`, `fixtures/` (the writers of
other frameworks' checkpoints), `attacks/`, `oracles/`.

pytest imports these files in its default "prepend" mode with no `__init__.py` in the test
folders: every test file's basename must be unique, and this folder is on sys.path, so tests
import the helpers as `from fixtures import ...`, `from attacks import ...`, `from e2e import ...`.
"""

import os
import re

DEVICES_ENV, PLATFORM_ENV = "HYBRIDCKPT_TEST_DEVICES", "HYBRIDCKPT_TEST_PLATFORM"
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def _devices_asked() -> int | None:
    text = os.environ.get(DEVICES_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise RuntimeError(f"${DEVICES_ENV}={text!r}: expected a positive device count")
    return int(text)


ASKED = _devices_asked()
os.environ.setdefault("JAX_PLATFORMS", os.environ.get(PLATFORM_ENV, "cpu"))
if os.environ["JAX_PLATFORMS"] == "cpu":
    _flags = os.environ.get("XLA_FLAGS", "")
    _given = _COUNT_FLAG.search(_flags)
    if ASKED is not None or _given is None:
        _flags = _COUNT_FLAG.sub("", _flags).strip()
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={ASKED or 8}".strip()
    # LLVM's optimisation of XLA's CPU code off (level 0, unless `$XLA_FLAGS` names a level): the
    # tests' computations are tiny, so compiling them is most of their cost, and LLVM's passes
    # most of a compilation (families/test_models.py: 63 -> 41 CPU-s). Neither level uses
    # fast-math: a float result may differ from the default level 3's in its last bits only (a
    # tiny Llama's fp32 logits and gradients: 2.2e-7 at most, its bf16 logits equal), far inside
    # every tolerance of the tests; the children the tests start inherit the flag, so results
    # compared across processes come from code compiled alike.
    if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --xla_backend_optimization_level=0"
    # XLA:CPU's older (elemental) emitters of fused loops, not its MLIR fusion emitters (unless
    # `$XLA_FLAGS` names `--xla_cpu_use_fusion_emitters`): the MLIR pipeline is most of what is
    # left of a tiny model's compilation at level 0 (a gemma2 forward on tp=4,pp=2: 0.56 -> 0.24
    # CPU-s; docs/testing.md, suite8a). Both emit the same operations in IEEE arithmetic without
    # fast-math; inherited by the children like the level above.
    if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --xla_cpu_use_fusion_emitters=false"
else:
    if ASKED is not None:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(ASKED))))
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import balance  # noqa: E402
import jax  # noqa: E402
import multidevice  # noqa: E402
import pytest  # noqa: E402
from fixtures.remote_servers import gcs, gcs_shared, local_sources, s3, s3_killable, s3_shared  # noqa: E402,F401

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_default_matmul_precision", "highest")

# One XLA compilation cache per test session, shared by pytest-xdist's workers (they inherit the
# controller's environment): many tests compile the same computation again (the same tiny model's
# forward on the same mesh, from a new `jax.jit` of a new lambda each time), which then is read
# back instead of compiled. Keyed by the computation, the devices and the compiler's flags (jax's
# own persistent cache), so it changes no result; made here and removed at the session's end
# (`$HYBRIDCKPT_TEST_JAX_CACHE`: a folder of one's own to keep, or `off`).
CACHE_ENV = "HYBRIDCKPT_TEST_JAX_CACHE"
if not os.environ.get(CACHE_ENV):
    import tempfile

    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="hybridckpt-test-jax-cache-")
    _CACHE_OWNED = True
else:
    _CACHE_OWNED = False
if os.environ[CACHE_ENV] != "off":  # `off`: every compilation compiled (to measure without)
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multidevice: builds meshes of several devices (given by conftest.py from the "
        "file's source); docs/testing.md reruns them at 4, 2 and 1 devices",
    )
    config.addinivalue_line(
        "markers", "multidevice_rerun: the multidevice tests of the files in multidevice.RERUN, "
        "which the README's test command reruns at 4 and 2 devices",
    )


def pytest_unconfigure(config):
    if _CACHE_OWNED:
        import shutil

        shutil.rmtree(os.environ[CACHE_ENV], ignore_errors=True)


def pytest_report_header(config):
    count = os.environ.get(DEVICES_ENV) or ("8 simulated" if os.environ["JAX_PLATFORMS"] == "cpu" else "all present")
    return f"hybridckpt: JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}, devices: {count}"


def pytest_ignore_collect(collection_path, config):
    # `-m multidevice_rerun` alone (the README's reruns at 4 and 2 devices) selects tests of the
    # files in multidevice.RERUN only (the marker is given by the file's path): the other test
    # files are not imported at all, rather than collected by each worker and deselected
    if config.getoption("markexpr", "").strip() != "multidevice_rerun":
        return None
    name = collection_path.name
    if collection_path.suffix == ".py" and name.startswith("test_") and collection_path.is_file():
        return True if not multidevice.is_rerun(str(collection_path), os.path.dirname(__file__)) else None
    return None


def pytest_collection_modifyitems(config, items):
    # a device count that was asked for is the one jax sees (else the run would prove nothing);
    # checked here, where tests are collected (pytest-xdist's workers), not in its controller
    if ASKED is not None and jax.device_count() != ASKED:
        raise pytest.UsageError(f"${DEVICES_ENV}={ASKED} but jax sees {jax.device_count()} devices: {jax.devices()}")
    tests = os.path.dirname(__file__)
    for item in items:
        function = item.cls.__name__ if item.cls is not None else item.originalname
        if multidevice.is_multidevice(str(item.path), function, tuple(item.fixturenames), tests):
            item.add_marker(pytest.mark.multidevice)
            if multidevice.is_rerun(str(item.path), tests):
                item.add_marker(pytest.mark.multidevice_rerun)
    # the longest files first (tests/balance.py): `-n 2` hands out whole files in this order
    items[:] = balance.longest_first(items, tests)


class MeshGuard:
    """While an unmarked test runs (set-up included), a mesh of several devices built through
    `hybridckpt.mesh.make_mesh` (what mesh_from_shape, the jobs and the CLI use) fails it: the
    source scan (multidevice.py) missed it, so the runs on fewer devices would leave it out."""

    def __init__(self, item):
        self.item = item

    def __enter__(self):
        import hybridckpt.mesh as mesh_module

        self.module, self.original = mesh_module, mesh_module.make_mesh
        original, item = self.original, self.item

        def guarded(*args, **kwargs):
            mesh = original(*args, **kwargs)
            if mesh.devices.size > 1:
                raise AssertionError(
                    f"{item.nodeid} builds a mesh of {mesh.devices.size} devices but "
                    "tests/multidevice.py does not see it: mark the test @pytest.mark.multidevice "
                    "so that the runs on fewer devices (docs/testing.md) include it"
                )
            return mesh

        mesh_module.make_mesh = guarded
        return self

    def __exit__(self, *exc):
        self.module.make_mesh = self.original


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("multidevice"):
        return (yield)
    with MeshGuard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("multidevice"):
        return (yield)
    with MeshGuard(item):
        return (yield)


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    """A file of 4096 float32 values 0..4095 (value == flat element index), for lazy-view tests."""
    import numpy as np

    path = tmp_path_factory.mktemp("lazy") / "blob.bin"
    np.arange(4096, dtype=np.float32).tofile(path)
    return str(path)
