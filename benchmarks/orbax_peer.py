"""The peer of a restore: Orbax's own restore of our store onto the same shardings (issue 42).

A JAX user without hybridckpt restores a checkpoint with Orbax: a `CheckpointManager` and
`args.StandardRestore` of each item onto target `jax.ShapeDtypeStruct`s that carry the new
shardings; TensorStore reads the chunks in its own threads. Our store is Orbax's format (raw zarr
chunk files, `use_ocdbt: false`), so Orbax restores it as it is. The peer gets what
`hybridckpt.restore(ck, mesh)` computes before it reads (the targets: shapes, saved dtypes,
shardings of the same plan), untimed; what is timed is Orbax's restore alone, from making the
manager to every array ready. It checks no CRC-32 (ours checks every chunk), so it does less.

    peer_child(ck, mesh) -> {"job_s", "cpu_s", "placed_bytes", "peak_rss_mb"}   (in this process)
    run_peer(ck, mesh)   -> the same, in a fresh process with the restore's process state

`tests/jobs/test_bench_baselines.py` checks that the peer's arrays equal our restore's bit for
bit, params and AdamW state, on another mesh.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from fresh_floors import back_memory, chunk_files, files_bytes, load_restore_modules  # noqa: E402


def targets(ck: str, mesh: str) -> tuple[int, dict]:
    """(step, {item: tree of ShapeDtypeStruct with shardings}) that `hybridckpt.restore(ck,
    mesh)` restores onto (`jobs.restore.targets`: the same code), params and, when saved, the
    optimizer state."""
    from hybridckpt.jobs import restore
    from hybridckpt.mesh import as_mesh
    from hybridckpt.store.manager import CheckpointStore

    with CheckpointStore(os.path.abspath(ck)) as store:
        state = store.trainer_state(None)
        step = int(state["step"])
        _, params, opt_state = restore.targets(store, state, step, as_mesh(mesh))
    return step, {"params": params, **({"opt_state": opt_state} if opt_state is not None else {})}


def orbax_restore(ck: str, step: int, items: dict) -> dict:
    """Orbax's restore of `items` (item -> target tree) of `step`, every array ready."""
    import jax
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(os.path.abspath(ck), item_names=tuple(items)) as manager:
        out = manager.restore(step, args=ocp.args.Composite(**{k: ocp.args.StandardRestore(t) for k, t in items.items()}))
        out = {k: out[k] for k in items}
        jax.block_until_ready(out)
    return out


def peer_child(ck: str, mesh: str) -> dict:
    """One Orbax restore in this process (the restore's modules loaded first, as ours is run)."""
    load_restore_modules()
    import jax
    import orbax.checkpoint  # noqa: F401  (loaded by our restore's process too)

    from hybridckpt.cli.output import peak_rss_gib

    step, items = targets(ck, mesh)
    back_memory(files_bytes(chunk_files(ck)))  # (as our restore's and each floor way's)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = orbax_restore(ck, step, items)
    job, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"job_s": job, "cpu_s": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime,
            "placed_bytes": sum(a.nbytes for a in jax.tree.leaves(out)), "peak_rss_mb": peak_rss_gib() * 1024}


def run_peer(ck: str, mesh: str) -> dict:
    """`peer_child` in a fresh process."""
    out = subprocess.run([sys.executable, HERE, "--_peer", ck, mesh], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_peer":
        print(json.dumps(peer_child(sys.argv[2], sys.argv[3])))
        return
    raise SystemExit("orbax_peer.py is run by restore_floor.py and import_sources_floor.py (--_peer CK MESH)")


if __name__ == "__main__":
    main()
