"""The path every real-tool case takes: import onto one mesh, restore on another, export (shared by
`test_real_meta.py`, `test_real_mistral.py`, `test_real_colossalai.py`).

Meshes come from the devices present (`jax.device_count()`): with 2 or more devices, mesh B shards
differently from mesh A (`e2e.roundtrip` asserts a real reshard); with one device both are `dp=1`
and the path runs without the reshard.
"""

from __future__ import annotations

import os

import jax
import numpy as np


def mesh_pair() -> tuple[str, str]:
    """(mesh A, mesh B) for the devices present: different shardings wherever there are two devices."""
    n = jax.device_count()
    if n >= 8:
        return "fsdp=2,tp=2,pp=2", "dp=2,tp=4"
    if n >= 4:
        return "fsdp=2,tp=2", "tp=4"
    if n >= 2:
        return "tp=2", "fsdp=2"
    return "dp=1", "dp=1"


def import_export(src: str, workdir, *, optimizer: bool, config: str | None = None):
    """(params, exp_avg, exp_avg_sq, step) of the export of `src` after import on mesh A and restore
    on mesh B, numpy dicts in HF names (`e2e.roundtrip`)."""
    from e2e import roundtrip

    from hybridckpt import jobs
    from hybridckpt.formats.registry import open_source

    a, b = mesh_pair()
    if a != b:
        return roundtrip(src, str(workdir), mesh_a=a, mesh_b=b, config=config, optimizer=optimizer)
    ckpt, out = os.path.join(str(workdir), "orbax"), os.path.join(str(workdir), "exported")
    jobs.import_checkpoint(src, ckpt, mesh=a, config=config)
    jobs.export_checkpoint(ckpt, out, optimizer=optimizer)
    exported = open_source(out)
    params = {k: v.materialize() for k, v in exported.tensors.items()}
    if not optimizer:
        return params, None, None, exported.step
    opt = exported.optimizer
    mu = {k: v.materialize() for k, v in opt.slots["exp_avg"].items()}
    nu = {k: v.materialize() for k, v in opt.slots["exp_avg_sq"].items()}
    return params, mu, nu, opt.step


def bitwise_equal(got: np.ndarray, want: np.ndarray) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(
        got.view(np.uint8), want.view(np.uint8)
    )
