"""Benchmark: save >= 1 GiB of fp32 params with the CheckpointStore, restore onto the same mesh
and onto a different mesh, on 8 simulated CPU devices.

    python benchmarks/restore_reshard.py [--gib 1.0] [--src fsdp=2,tp=2,pp=2] [--dst tp=4,fsdp=2]

Prints one table: seconds and GB/s (1 GB = 1e9 bytes) for the save (synchronous, until the
step is committed) and for each restore (until every shard is on its device), and the ratio
cross-mesh / same-mesh restore time. The files were just written, so restores read from the
page cache: this measures Orbax/TensorStore decoding plus resharding, not the disk. Every
restored array is checked against the source by a bit checksum. The checkpoint lives in a
temporary directory under /tmp that is removed at the end.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from hybridckpt.mesh import mesh_from_shape, tree_shardings  # noqa: E402
from hybridckpt.plan import abstract_tree  # noqa: E402
from hybridckpt.store import CheckpointStore  # noqa: E402

HIDDEN, MLP, VOCAB = 2048, 4096, 32768
AXES = {
    "embed": {"embedding": ("vocab", "embed")},
    "layers": {
        "mlp_in": {"kernel": ("layers", "embed", "mlp")},
        "mlp_out": {"kernel": ("layers", "mlp", "embed")},
    },
}


def shapes(gib: float) -> dict:
    """A stacked-layer model of about `gib` GiB fp32: embedding [vocab, hidden] plus two MLP
    kernels [layers, hidden, mlp] / [layers, mlp, hidden]; layers is a multiple of 8."""
    per_layer = 2 * HIDDEN * MLP * 4
    layers = max(8, round((gib * 2**30 - VOCAB * HIDDEN * 4) / per_layer / 8) * 8)
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    return {
        "embed": {"embedding": sds(VOCAB, HIDDEN)},
        "layers": {
            "mlp_in": {"kernel": sds(layers, HIDDEN, MLP)},
            "mlp_out": {"kernel": sds(layers, MLP, HIDDEN)},
        },
    }


def fill(shape: tuple[int, ...], seed: int) -> jax.Array:
    """Floats in [1, 2) whose mantissas are a multiplicative hash of the element index."""
    idx = jax.lax.iota(jnp.uint32, math.prod(shape))
    bits = ((idx + jnp.uint32(seed)) * jnp.uint32(2654435761)) >> 9 | jnp.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(shape)


@jax.jit
def checksums(tree):
    """Per-array wrapping sum of the float bits: equal iff (almost surely) bit-identical."""
    return jax.tree.map(
        lambda a: jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint32), dtype=jnp.uint32), tree
    )


def timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="param size in GiB (>= ~0.3)")
    parser.add_argument("--src", default="fsdp=2,tp=2,pp=2", help="mesh the params are saved from")
    parser.add_argument("--dst", default="fsdp=2,tp=4", help="the other mesh to restore onto")
    args = parser.parse_args()

    sds = shapes(args.gib)
    src_mesh, dst_mesh = mesh_from_shape(args.src), mesh_from_shape(args.dst)
    src_sh = tree_shardings(sds, AXES, src_mesh)
    dst_sh = tree_shardings(sds, AXES, dst_mesh)
    leaves, treedef = jax.tree.flatten(sds)
    shard_leaves = treedef.flatten_up_to(src_sh)
    params = jax.tree.unflatten(
        treedef,
        [
            jax.jit(lambda s=leaf.shape, i=i: fill(s, i), out_shardings=sh)()
            for i, (leaf, sh) in enumerate(zip(leaves, shard_leaves, strict=True))
        ],
    )
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    want = jax.device_get(checksums(params))

    tmp = tempfile.mkdtemp(prefix="hybridckpt-bench-", dir="/tmp")
    rows = []
    try:
        with CheckpointStore(os.path.join(tmp, "ckpt"), async_save=False) as store:
            _, t_save = timed(lambda p=params: store.save(1, p, trainer_state={"bench": True}))
            rows.append(("save", args.src, t_save))
            del params
            for label, mesh_text, shardings in (
                ("restore same mesh", args.src, src_sh),
                ("restore other mesh", args.dst, dst_sh),
            ):
                target = abstract_tree(sds, shardings)
                out, t = timed(lambda target=target: store.restore(1, target_params=target).params)
                if jax.device_get(checksums(out)) != want:
                    raise SystemExit(f"{label}: restored values differ from the saved ones")
                for got, tgt in zip(jax.tree.leaves(out), jax.tree.leaves(target), strict=True):
                    assert got.sharding == tgt.sharding, (got.sharding, tgt.sharding)
                del out
                rows.append((label, mesh_text, t))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"params: {nbytes / 2**30:.2f} GiB fp32 in {len(leaves)} arrays, 8 CPU devices")
    print(f"{'operation':<20} {'mesh':<18} {'seconds':>8} {'GB/s':>7}")
    for label, mesh_text, t in rows:
        print(f"{label:<20} {mesh_text:<18} {t:>8.2f} {nbytes / t / 1e9:>7.2f}")
    print(f"cross/same restore time ratio: {rows[2][2] / rows[1][2]:.2f}")


def restore_imported(ckpt: str, mesh_text: str) -> float:
    """Seconds to restore the params of an imported checkpoint (`hybridckpt import`) onto
    `mesh_text` of the 8 devices, every shard on its device (used by benchmarks/run_all.py)."""
    from hybridckpt import models
    from hybridckpt.store import load_params_metadata, read_trainer_state

    cfg = models.config_from_dict(read_trainer_state(ckpt)["model_config"])
    saved = load_params_metadata(ckpt)
    shard = tree_shardings(saved, models.logical_axes(cfg), mesh_from_shape(mesh_text))
    target = abstract_tree(saved, shard)
    with CheckpointStore(ckpt) as store:
        _, t = timed(lambda: store.restore(target_params=target).params)
    return t


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 4 and sys.argv[1] == "--_restore":
        print(restore_imported(sys.argv[2], sys.argv[3]))
    else:
        main()
