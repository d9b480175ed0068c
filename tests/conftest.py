"""Test session set-up: 8 simulated host devices before jax initialises (the same tests run on GPUs).

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

os.environ.setdefault("JAX_PLATFORMS", os.environ.get("HYBRIDCKPT_TEST_PLATFORM", "cpu"))
if os.environ["JAX_PLATFORMS"] == "cpu":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    """A file of 4096 float32 values 0..4095 (value == flat element index), for lazy-view tests."""
    import numpy as np

    path = tmp_path_factory.mktemp("lazy") / "blob.bin"
    np.arange(4096, dtype=np.float32).tofile(path)
    return str(path)
