"""Our checkpoint on disk, and the plain records that describe it.

Layout on disk (one `orbax.checkpoint.CheckpointManager` root, default step naming):

    DIR/<step>/params/          StandardSave of the params pytree (global jax.Arrays; OCDBT, or
                                a folder per array with a file per raw chunk for a raw import)
    DIR/<step>/opt_state/       StandardSave of the optax state (optional; NamedTuples are
                                stored as lists/dicts and restored into the target's structure)
    DIR/<step>/trainer_state/   JSON dict, keys below
    DIR/<step>/hf_files/        the source's config, generation config and tokenizer files, as
                                they were (an import's; `io.model_files`), for an HF export
    DIR/<step>/_CHECKPOINT_METADATA, commit_success.txt   written by Orbax

`trainer_state` keys (all JSON): `step` (int, equal to the step directory), `mesh` (the
MeshShape dict `{"dp","fsdp","tp","pp"}` the params were saved from), and, when known,
`consumed_samples` or `batch_index` (ints), `rng` (raw PRNG key data as a list of uint32 ints,
see `rng_to_json`), `lr` (float), `loss`, `best_loss` (floats), `model_config` (dict),
`global_batch_size` (int, sequences per optimizer step), `metrics` (dict of floats), `hf_files`
(name -> {"bytes", "crc32"} of each file in `hf_files/`), plus any extra key the caller adds.

Restoring never depends on the saving mesh: the caller gives abstract targets
(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`, see `abstract_tree`) on the target mesh and
every device reads only its own shard; values come back bit for bit. Before any array is read,
the saved tree is checked against the target (missing / unexpected keys, shapes) from the Orbax
metadata, and the saved global batch size against the new one.

This module holds the names of the items, the JSON forms of trainer-state values, and the records
`TopologyChange` / `Restored`; the Orbax plumbing is `store.orbax_io`, the store itself
`store.manager`, the one-shot atomic save `store.save`, the streaming data path `store.stream`, the
lazy reader `containers.orbax.reader`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from hybridckpt.mesh import MeshShape

PARAMS, OPT_STATE, TRAINER_STATE = "params", "opt_state", "trainer_state"
HF_FILES = "hf_files"  # a folder of plain files, not an Orbax item: restore it with the items named


def has_shape(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def rng_to_json(key: Any) -> list[int]:
    """Raw key data of a PRNG key (typed `jax.random.key` or legacy uint32 `PRNGKey`) as ints."""
    if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(v) for v in np.asarray(key).reshape(-1)]


def rng_from_json(data: list[int]) -> jax.Array:
    """The legacy uint32 key array (`jax.random.PRNGKey` layout) from `rng_to_json` output."""
    return jax.numpy.asarray(np.asarray(data, dtype=np.uint32))


def leaf_key(path: tuple) -> str:
    """`0.mu.embed.embedding`: the same dotted name Orbax gives a leaf on disk."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def flat_leaves(tree: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=has_shape)
    return {leaf_key(path): leaf for path, leaf in flat}


def short_list(keys: set[str], limit: int = 12) -> str:
    keys_sorted = sorted(keys)
    more = f" ... ({len(keys_sorted) - limit} more)" if len(keys_sorted) > limit else ""
    return ", ".join(keys_sorted[:limit]) + more


def mesh_of_tree(tree: Any) -> tuple[MeshShape | None, int]:
    """(MeshShape, device count) of the first NamedSharding in `tree` (arrays or abstract)."""
    devices: set = set()
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=has_shape):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return MeshShape.of(sharding.mesh), int(sharding.mesh.size)
        if sharding is not None:
            devices |= set(sharding.device_set)
    return None, len(devices)



@dataclass(frozen=True)
class TopologyChange:
    """What differs between the saving run and the restoring run (mesh, devices, batch size)."""

    saved_mesh: MeshShape | None
    target_mesh: MeshShape | None
    saved_devices: int | None
    target_devices: int
    saved_global_batch_size: int | None = None
    target_global_batch_size: int | None = None
    consumed_samples: int | None = None

    @property
    def mesh_changed(self) -> bool:
        return self.saved_mesh != self.target_mesh or self.saved_devices != self.target_devices

    @property
    def batch_size_changed(self) -> bool:
        return (
            self.saved_global_batch_size is not None
            and self.target_global_batch_size is not None
            and self.saved_global_batch_size != self.target_global_batch_size
        )

    @property
    def changed(self) -> bool:
        return self.mesh_changed or self.batch_size_changed

    @property
    def lines(self) -> tuple[str, ...]:
        """Human-readable report, one fact per line."""

        def where(mesh: MeshShape | None, n: int | None) -> str:
            count = "? devices" if n is None else f"{n} device{'' if n == 1 else 's'}"
            return f"{mesh if mesh else 'unknown mesh'} ({count})"

        saved = where(self.saved_mesh, self.saved_devices)
        target = where(self.target_mesh, self.target_devices)
        if not self.mesh_changed:
            out = [f"mesh unchanged: {target}"]
        else:
            out = [f"mesh changed: saved on {saved}, restoring onto {target}"]
            if self.saved_mesh and self.target_mesh:
                old, new = self.saved_mesh.as_dict(), self.target_mesh.as_dict()
                out += [f"  {a}: {old[a]} -> {new[a]}" for a in old if old[a] != new[a]]
        if self.batch_size_changed:
            line = (
                f"global batch size changed: {self.saved_global_batch_size} -> "
                f"{self.target_global_batch_size}"
            )
            if self.consumed_samples is not None:
                line += (
                    f"; consumed_samples={self.consumed_samples} is batch_index "
                    f"{self.consumed_samples // self.target_global_batch_size} at the new size"
                )
            out.append(line)
        elif self.saved_global_batch_size is not None:
            out.append(f"global batch size unchanged: {self.saved_global_batch_size}")
        return tuple(out)

    def __str__(self) -> str:
        return "\n".join(self.lines)


@dataclass(frozen=True)
class Restored:
    """The result of `CheckpointStore.restore`.

    params / opt_state: trees of jax.Arrays with the target's structure and shardings
    (`opt_state` is None when not requested). With `strict=False`, leaves listed in
    `missing_keys` are the target's ShapeDtypeStruct (nothing was saved for them) and saved
    leaves listed in `unexpected_keys` were not read. `notes`: the plan's (`hybridckpt.restore`),
    e.g. a dimension the mesh cannot divide, replicated.
    """

    step: int
    params: Any
    opt_state: Any
    trainer_state: dict
    topology: TopologyChange
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    tx: Any = None  # the optax optimizer rebuilt from the checkpoint (`restore(optimizer="from-checkpoint")`)
    notes: tuple[str, ...] = ()
    profile: Any = None  # `hybridckpt.restore(profile=True)`: where the time went (`io.timing.Profile`)
