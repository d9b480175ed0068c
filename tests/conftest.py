"""Test session set-up: 8 simulated host devices before jax initialises (the same tests run on GPUs)."""

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
