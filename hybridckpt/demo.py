"""`hybridckpt demo`: the whole job on the built-in sample, with only the base install.

1. import the sample (a tiny Llama in the single-card HF layout, with Adam moments) into an
   Orbax checkpoint on mesh fsdp=2,tp=2,pp=2;
2. restore it onto another mesh (dp=2,tp=4) and report the topology change;
3. export the Orbax checkpoint back to the single-card layout, optimizer included;
4. verify the export equals the sample bit for bit, and the logits of both agree.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources

import numpy as np

SAMPLE = "tiny-llama"


def sample_path() -> str:
    return str(resources.files("hybridckpt").joinpath("samples", SAMPLE))


def run(workdir: str | None = None, keep: bool = False) -> int:
    import jax

    from hybridckpt import jobs
    from hybridckpt.jobs.restore import restore

    work = workdir or tempfile.mkdtemp(prefix="hybridckpt-demo-")
    os.makedirs(work, exist_ok=True)
    src = sample_path()
    ckpt = os.path.join(work, "orbax")
    out = os.path.join(work, "exported")
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    n = len(jax.devices())
    mesh_a = "fsdp=2,tp=2,pp=2" if n >= 8 else "dp=1"
    mesh_b = "dp=2,tp=4" if n >= 8 else "dp=1"
    temporary = workdir is None and not keep
    print(f"sample:   {src} (tiny Llama, HF safetensors + optimizer.safetensors)")
    print(f"devices:  {n} x {jax.devices()[0].platform}")
    print(f"folder:   {work}" + (" (temporary: deleted when the demo ends; --keep or --workdir DIR keeps the files)"
                                 if temporary else " (kept)"))

    s = jobs.import_checkpoint(src, ckpt, mesh=mesh_a)
    print(f"1. import -> {ckpt}: step {s.step}, mesh {s.mesh}, {s.tensors} arrays "
          f"({s.bytes / 1e3:.0f} kB), optimizer state: {'yes' if s.with_optimizer else 'no'}")

    _, r = restore(ckpt, mesh_b if n >= 8 else "dp=1")
    q = r.params["layers"]["q"]["kernel"]
    print(f"2. restore onto mesh {mesh_b}: step {r.step}; layers.q.kernel {q.shape} now {q.sharding.spec}, "
          f"Adam count {int(np.asarray(r.opt_state[0].count))}")
    for line in r.topology.lines:
        print(f"   {line}")

    e = jobs.export_checkpoint(ckpt, out, optimizer=True)
    print(f"3. export -> {out}: {', '.join(e.files)}")

    rows, only_a, only_b = jobs.verify(src, out)
    same = all(r.max_abs_diff == 0 for r in rows) and not only_a and not only_b
    a = jobs.open_checkpoint(src).named
    b = jobs.open_checkpoint(out).named
    moments_same = a.slots.keys() == b.slots.keys() and all(
        np.array_equal(t[k].materialize(), b.slots[s][k].materialize())
        for s, t in a.slots.items()
        for k in t
    )
    tokens = [1, 7, 3, 42, 9, 11]
    la = jobs.logits(src, tokens, mesh=mesh_a)
    lb = jobs.logits(out, tokens, mesh=mesh_b)
    print(f"4. verify: {len(rows)} weights bitwise equal: {same}; optimizer slots bitwise equal: {moments_same}; "
          f"step {a.step} -> {b.step}; logits max|diff| {float(np.abs(la - lb).max()):.2g}")
    if temporary:
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed {work} (the demo's temporary folder)")
    else:
        print(f"files kept in {work}: hybridckpt inspect {ckpt}")
    ok = same and moments_same and a.step == b.step
    print("demo: OK" if ok else "demo: MISMATCH")
    return 0 if ok else 1
