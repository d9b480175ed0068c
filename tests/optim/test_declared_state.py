"""An import plans its optimizer state from the optimizer's declared layout (`Optimizer.layout`),
not by importing optax and tracing its `init` (issue 42: 141 modules, about 0.07 CPU-s of the
import's serial start): the declared tree is optax's, path for path and leaf for leaf; an import
loads no optax module; and the files it writes are byte for byte those of the optax-planned import."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from meshes import fit

from hybridckpt import optim
from hybridckpt.demo import sample_path
from hybridckpt.jobs.import_ import import_checkpoint

PARAMS = {"embed": jax.ShapeDtypeStruct((16, 8), np.float32),
          "layers": {"q": jax.ShapeDtypeStruct((2, 8, 8), np.float32), "norm": jax.ShapeDtypeStruct((2, 8), np.float32)}}


def leaves_by_path(tree) -> list[tuple[str, tuple, str]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), tuple(x.shape), np.dtype(x.dtype).name) for p, x in flat]


@pytest.mark.parametrize("name", sorted(optim.all_optimizers()))
def test_declared_layout_is_optax_tree(name):
    opt = optim.get(name)
    assert opt.layout is not None, f"{name}: no declared layout (an import would import optax)"
    traced = optim.abstract_state(opt, PARAMS)
    declared = optim.abstract_state(opt, PARAMS, declared=True)
    assert type(traced[0]).__module__.startswith("optax")  # the two are not the same object: one is optax's
    assert not type(declared[0]).__module__.startswith("optax")
    assert leaves_by_path(declared) == leaves_by_path(traced)
    assert len(leaves_by_path(traced)) > 1
    # the containers too: each state's fields in order (the files name the paths in this order)
    assert [getattr(s, "_fields", None) for s in declared] == [getattr(s, "_fields", None) for s in traced]


def test_import_plan_loads_no_optax(tmp_path):
    """Counted in a fresh process: the modules an import's plan (`lazy_targets`) loads."""
    code = (
        "import sys, jax, orbax.checkpoint\n"
        "from hybridckpt.jobs.open import open_checkpoint\n"
        "from hybridckpt.jobs.import_ import lazy_targets\n"
        f"o = open_checkpoint({sample_path()!r})\n"
        "before = set(sys.modules)\n"
        "lt = lazy_targets(o, mesh='fsdp=2')\n"
        "assert lt.opt_state is not None and len(lt.leaves) > 10\n"
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'optax'))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def files_of(root: str) -> dict[str, bytes]:
    """Every file of an import by its path under the step, less Orbax's timestamps (its
    `_CHECKPOINT_METADATA` and `commit_success.txt` say when they were written)."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            rel = os.path.relpath(os.path.join(d, f), root)
            if f not in ("_CHECKPOINT_METADATA", "commit_success.txt"):
                with open(os.path.join(d, f), "rb") as fh:
                    out[rel] = fh.read()
    return out


def test_declared_import_writes_the_optax_bytes(tmp_path, monkeypatch):
    declared = import_checkpoint(sample_path(), str(tmp_path / "declared"), mesh=fit("fsdp=2"))
    calls = []
    original = optim.abstract_state

    def traced(opt, shapes, *, declared=False):
        calls.append(declared)
        return original(opt, shapes)  # optax's classes, as before the layouts were declared

    monkeypatch.setattr(optim, "abstract_state", traced)
    by_optax = import_checkpoint(sample_path(), str(tmp_path / "optax"), mesh=fit("fsdp=2"))
    assert calls == [True]  # the import asked for the declared tree; this one got optax's
    assert declared.with_optimizer and declared.tensors == by_optax.tensors
    a, b = files_of(str(tmp_path / "declared")), files_of(str(tmp_path / "optax"))
    assert sorted(a) == sorted(b)
    assert any("opt_state" in k and k.endswith("_METADATA") for k in a)
    assert {k for k in a if a[k] != b[k]} == set()
