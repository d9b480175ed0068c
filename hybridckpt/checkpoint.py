"""The Orbax checkpoint store: save params / optimizer state / trainer state, restore onto any mesh.

Layout on disk (one `orbax.checkpoint.CheckpointManager` root, default step naming):

    DIR/<step>/params/          StandardSave of the params pytree (global jax.Arrays, OCDBT)
    DIR/<step>/opt_state/       StandardSave of the optax state (optional; NamedTuples are
                                stored as lists/dicts and restored into the target's structure)
    DIR/<step>/trainer_state/   JSON dict, keys below
    DIR/<step>/_CHECKPOINT_METADATA, commit_success.txt   written by Orbax

`trainer_state` keys (all JSON): `step` (int, equal to the step directory), `mesh` (the
MeshShape dict `{"dp","fsdp","tp","pp"}` the params were saved from), and, when known,
`consumed_samples` or `batch_index` (ints), `rng` (raw PRNG key data as a list of uint32 ints,
see `rng_to_json`), `lr` (float), `loss`, `best_loss` (floats), `model_config` (dict),
`global_batch_size` (int, sequences per optimizer step), `metrics` (dict of floats), plus any
extra key the caller adds.

Restoring never depends on the saving mesh: the caller gives abstract targets
(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`, see `abstract_tree`) on the target mesh and
every device reads only its own shard; values come back bit for bit. Before any array is read,
the saved tree is checked against the target (missing / unexpected keys, shapes) from the Orbax
metadata, and the saved global batch size against the new one.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, Sharding

from hybridckpt.errors import CheckpointError
from hybridckpt.mesh import MeshShape

__all__ = [
    "CheckpointStore",
    "Restored",
    "TopologyChange",
    "abstract_tree",
    "latest_step",
    "list_steps",
    "load_params_metadata",
    "read_trainer_state",
    "rng_from_json",
    "rng_to_json",
    "save_checkpoint",
]

PARAMS, OPT_STATE, TRAINER_STATE = "params", "opt_state", "trainer_state"


class _QuietOrbax(logging.Filter):
    """Drop Orbax's info/warning chatter (it logs through absl); keep its errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


if not any(isinstance(f, _QuietOrbax) for f in logging.getLogger("absl").filters):
    logging.getLogger("absl").addFilter(_QuietOrbax())


# ----------------------------------------------------------------------------- pure helpers


def _has_shape(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def abstract_tree(shapes_tree: Any, shardings_tree: Any, dtype: Any = None) -> Any:
    """`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` for every leaf of `shapes_tree`.

    shapes_tree: a pytree whose leaves have `.shape` and `.dtype` (ShapeDtypeStruct, arrays,
      the output of `jax.eval_shape` or `load_params_metadata`).
    shardings_tree: the same structure with a `Sharding` per leaf, or one `Sharding` for all.
    dtype: if given, replaces the dtype of floating-point leaves only (integer counters such as
      adam's `count` keep theirs).
    """
    leaves, treedef = jax.tree_util.tree_flatten(shapes_tree, is_leaf=_has_shape)
    if isinstance(shardings_tree, Sharding):
        shardings = [shardings_tree] * len(leaves)
    else:
        shardings = treedef.flatten_up_to(shardings_tree)
    out = []
    for leaf, sharding in zip(leaves, shardings, strict=True):
        dt = np.dtype(leaf.dtype)
        if dtype is not None and jax.numpy.issubdtype(dt, np.floating):
            dt = np.dtype(dtype)
        out.append(jax.ShapeDtypeStruct(tuple(leaf.shape), dt, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def rng_to_json(key: Any) -> list[int]:
    """Raw key data of a PRNG key (typed `jax.random.key` or legacy uint32 `PRNGKey`) as ints."""
    if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(v) for v in np.asarray(key).reshape(-1)]


def rng_from_json(data: list[int]) -> jax.Array:
    """The legacy uint32 key array (`jax.random.PRNGKey` layout) from `rng_to_json` output."""
    return jax.numpy.asarray(np.asarray(data, dtype=np.uint32))


def _key(path: tuple) -> str:
    """`0.mu.embed.embedding`: the same dotted name Orbax gives a leaf on disk."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _flat(tree: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_has_shape)
    return {_key(path): leaf for path, leaf in flat}


def _names(keys: set[str], limit: int = 12) -> str:
    keys_sorted = sorted(keys)
    more = f" ... ({len(keys_sorted) - limit} more)" if len(keys_sorted) > limit else ""
    return ", ".join(keys_sorted[:limit]) + more


def _mesh_of_tree(tree: Any) -> tuple[MeshShape | None, int]:
    """(MeshShape, device count) of the first NamedSharding in `tree` (arrays or abstract)."""
    devices: set = set()
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=_has_shape):
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
    leaves listed in `unexpected_keys` were not read.
    """

    step: int
    params: Any
    opt_state: Any
    trainer_state: dict
    topology: TopologyChange
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- Orbax plumbing


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    from hybridckpt.stream import StreamingCheckpointHandler

    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in (PARAMS, OPT_STATE):
        # StandardCheckpointHandler that also streams `stream.LazyLeaf` leaves
        handler = StreamingCheckpointHandler()
        registry.add(item, ocp.args.StandardSave, handler)
        registry.add(item, ocp.args.StandardRestore, handler)
    json_handler = ocp.JsonCheckpointHandler()
    registry.add(TRAINER_STATE, ocp.args.JsonSave, json_handler)
    registry.add(TRAINER_STATE, ocp.args.JsonRestore, json_handler)
    return registry


def _standard_save(tree: Any) -> ocp.args.StandardSave:
    """StandardSave of a tree of jax.Arrays and/or `stream.LazyLeaf`s (the latter with their
    chunking SaveArgs: written tile by tile, see `hybridckpt.stream`)."""
    from hybridckpt import stream

    if stream.has_lazy(tree):
        return ocp.args.StandardSave(tree, save_args=stream.save_args(tree))
    return ocp.args.StandardSave(tree)


def _read_only_manager(directory: str | os.PathLike) -> ocp.CheckpointManager:
    path = Path(directory).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint directory there")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(path, options=options, handler_registry=_registry())


def _resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    steps = list(manager.all_steps())
    if not steps:
        raise CheckpointError(f"{manager.directory}: no checkpoints found")
    if step is None:
        return max(steps)
    if step not in steps:
        raise CheckpointError(
            f"{manager.directory}: no checkpoint for step {step} (steps found: {sorted(steps)})"
        )
    return int(step)


def _item_metadata(manager: ocp.CheckpointManager, step: int, item: str) -> Any | None:
    """The saved tree of Orbax ArrayMetadata for `item`, or None when the step lacks it."""
    meta = manager.metadata(step).item_metadata
    tree = meta.get(item) if meta is not None and item in meta else None
    return None if tree is None else tree.tree


def _as_shape_dtype(meta_tree: Any) -> Any:
    return jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)),
        meta_tree,
        is_leaf=_has_shape,
    )


def _read_json(manager: ocp.CheckpointManager, step: int) -> dict:
    out = manager.restore(step, args=ocp.args.Composite(trainer_state=ocp.args.JsonRestore()))
    state = out[TRAINER_STATE]
    if not isinstance(state, dict):
        raise CheckpointError(f"{manager.directory}/{step}/{TRAINER_STATE}: not a JSON object")
    return state


def _check_tree(
    where: str, saved_meta: Any, target: Any, strict: bool
) -> tuple[set[str], set[str]]:
    """Compare a saved tree (Orbax metadata) with an abstract target; returns (missing,
    unexpected) key sets. Shapes must agree; keys must agree when `strict`."""
    saved, wanted = _flat(saved_meta), _flat(target)
    missing, unexpected = set(wanted) - set(saved), set(saved) - set(wanted)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_names(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the target: {_names(unexpected)}")
        raise CheckpointError(
            f"{where}: saved tree does not match the target ({'; '.join(parts)}); "
            f"pass strict=False to restore the common keys only"
        )
    for key in sorted(set(saved) & set(wanted)):
        leaf = wanted[key]
        if tuple(saved[key].shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"{where}: {key} has shape {tuple(saved[key].shape)} in the checkpoint but the "
                f"target expects {tuple(leaf.shape)}"
            )
        if getattr(leaf, "sharding", None) is None:
            raise CheckpointError(
                f"{where}: target leaf {key} has no sharding; build targets with abstract_tree"
            )
    return missing, unexpected


def _partial_item(saved_meta: Any, wanted: dict[str, Any], prefix: tuple = ()) -> Any:
    """The saved tree (dicts / lists as Orbax stores them) keeping only leaves in `wanted`,
    each replaced by its abstract target; dropped list slots become None (empty)."""
    if isinstance(saved_meta, Mapping):
        out = {}
        for k, v in saved_meta.items():
            sub = _partial_item(v, wanted, (*prefix, jax.tree_util.DictKey(k)))
            if sub is not None:
                out[k] = sub
        return out or None
    if isinstance(saved_meta, list | tuple):
        out_list = [
            _partial_item(v, wanted, (*prefix, jax.tree_util.SequenceKey(i)))
            for i, v in enumerate(saved_meta)
        ]
        return None if all(v is None for v in out_list) else out_list
    if saved_meta is None:
        return None
    return wanted.get(_key(prefix))


def _restore_partial(step_dir: Path, item: str, saved_meta: Any, target: Any) -> Any:
    """Restore the keys common to the saved tree and `target`; missing leaves stay abstract."""
    _, treedef = jax.tree_util.tree_flatten(target, is_leaf=_has_shape)
    wanted = _flat(target)
    sub = _partial_item(saved_meta, wanted)
    got: dict[str, Any] = {}
    if sub is not None:
        args = ocp.args.PyTreeRestore(
            item=sub,
            restore_args=ocp.checkpoint_utils.construct_restore_args(sub),
            partial_restore=True,
        )
        with ocp.PyTreeCheckpointer() as checkpointer:
            got = _flat(checkpointer.restore(step_dir / item, args=args))
    leaves = [got.get(key, leaf) for key, leaf in wanted.items()]
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- the store


def _metric(name: str, metrics: Mapping[str, float]) -> float:
    return float(metrics[name])


class CheckpointStore:
    """Orbax CheckpointManager over items `params`, `opt_state` (optional) and `trainer_state`.

    save_interval_steps: `save` writes only when `step % save_interval_steps == 0`
      (`force=True` writes anyway).
    max_to_keep: keep the newest N steps (None: keep all).
    keep_best_by: a metric name (e.g. "loss"), read from `trainer_state["metrics"]` or
      `trainer_state`; then the `max_to_keep` best steps by it (`best_mode` "min" or "max")
      are kept, plus always the newest step so training can resume.
    async_save: `save` returns once arrays are copied off the devices; call `wait()` (or
      `close()`) before reading the files.
    save_optimizer: False drops `opt_state` from every save.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_interval_steps: int = 1,
        max_to_keep: int | None = None,
        keep_best_by: str | None = None,
        best_mode: str = "min",
        async_save: bool = False,
        save_optimizer: bool = True,
    ) -> None:
        if save_interval_steps < 1:
            raise CheckpointError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        if best_mode not in ("min", "max"):
            raise CheckpointError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        self.directory = Path(directory).absolute()
        self.keep_best_by = keep_best_by
        self.save_optimizer = save_optimizer
        policies = ocp.checkpoint_managers
        preserve: Any = policies.LatestN(n=max_to_keep)
        best_fn = None if keep_best_by is None else functools.partial(_metric, keep_best_by)
        if best_fn is not None:
            best_n = policies.BestN(
                get_metric_fn=best_fn, reverse=best_mode == "min", n=max_to_keep
            )
            preserve = policies.AnyPreservationPolicy([policies.LatestN(n=1), best_n])
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(
                [
                    policies.FixedIntervalPolicy(save_interval_steps),
                    policies.PreemptionCheckpointingPolicy(),
                ]
            ),
            preservation_policy=preserve,
            best_fn=best_fn,
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=_registry()
        )

    # -- context / lifetime
    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait(self) -> None:
        """Block until every pending (async) save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    # -- queries
    def steps(self) -> list[int]:
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The best step by `keep_best_by` (the latest step when no metric is tracked)."""
        return self._manager.best_step()

    def should_save(self, step: int) -> bool:
        return bool(self._manager.should_save(step))

    def trainer_state(self, step: int | None = None) -> dict:
        self._manager.wait_until_finished()
        return _read_json(self._manager, _resolve_step(self._manager, step))

    def params_metadata(self, step: int | None = None) -> Any:
        """Saved params as a tree of `jax.ShapeDtypeStruct` (no sharding); reads no arrays."""
        self._manager.wait_until_finished()
        step = _resolve_step(self._manager, step)
        return _as_shape_dtype(_item_metadata(self._manager, step, PARAMS))

    # -- save
    def _trainer_json(self, step: int, params: Any, trainer_state: Mapping | None) -> dict:
        state = dict(trainer_state or {})
        if "step" in state and int(state["step"]) != step:
            raise CheckpointError(
                f"{self.directory}: trainer_state['step']={state['step']} but saving step {step}"
            )
        state["step"] = int(step)
        if "mesh" not in state:
            mesh, _ = _mesh_of_tree(params)
            state["mesh"] = (mesh or MeshShape()).as_dict()
        elif isinstance(state["mesh"], MeshShape):
            state["mesh"] = state["mesh"].as_dict()
        if "rng" in state and not isinstance(state["rng"], list):
            state["rng"] = rng_to_json(state["rng"])
        for key, value in state.items():
            if isinstance(value, np.generic | jax.Array) and np.ndim(value) == 0:
                state[key] = value = value.item()  # a loss given as a device / numpy scalar
            try:
                json.dumps(value, allow_nan=True)
            except TypeError as e:
                raise CheckpointError(
                    f"{self.directory}: trainer_state[{key!r}] is not JSON-serialisable "
                    f"({type(value).__name__}): {e}"
                ) from e
        return state

    def _metrics(self, step: int, state: dict) -> dict | None:
        if self.keep_best_by is None:
            return None
        name = self.keep_best_by
        metrics = state.get("metrics") or {}
        value = metrics.get(name, state.get(name))
        if value is None:
            raise CheckpointError(
                f"{self.directory}: keep_best_by={name!r} but step {step}'s trainer_state has "
                f"no {name!r} (neither trainer_state[{name!r}] nor trainer_state['metrics'])"
            )
        return {name: float(value)}

    def save(
        self,
        step: int,
        params: Any,
        opt_state: Any = None,
        trainer_state: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Save `params` (and `opt_state` unless None or save_optimizer=False) at `step`.

        Returns False when the save interval skips this step. `trainer_state` gets `step` and
        `mesh` (taken from the params' shardings) filled in. A step that already exists is an
        error.
        """
        if not force and not self._manager.should_save(step):
            return False
        state = self._trainer_json(step, params, trainer_state)
        items: dict[str, Any] = {PARAMS: _standard_save(params)}
        if opt_state is not None and self.save_optimizer:
            items[OPT_STATE] = _standard_save(opt_state)
        items[TRAINER_STATE] = ocp.args.JsonSave(state)
        try:
            return bool(
                self._manager.save(
                    step,
                    args=ocp.args.Composite(**items),
                    metrics=self._metrics(step, state),
                    force=True,
                )
            )
        except ocp.checkpoint_manager.StepAlreadyExistsError as e:
            raise CheckpointError(f"{self.directory}: step {step} already exists") from e

    # -- restore
    def restore(
        self,
        step: int | None = None,
        *,
        target_params: Any,
        target_opt_state: Any = None,
        global_batch_size: int | None = None,
        allow_batch_size_change: bool = False,
        strict: bool = True,
    ) -> Restored:
        """Restore `step` (default: latest) onto the shardings carried by the targets.

        target_params / target_opt_state: trees of `jax.ShapeDtypeStruct` with `.sharding`
          (see `abstract_tree`); `target_opt_state=None` skips the optimizer state.
        global_batch_size: the new run's batch size; a change from the saved one is refused
          unless `allow_batch_size_change`.
        strict: missing / unexpected keys are an error; with False the common keys are
          restored and the others reported in `Restored.missing_keys / unexpected_keys`.
        """
        manager = self._manager
        manager.wait_until_finished()  # a pending async save must be on disk before reading
        step = _resolve_step(manager, step)
        where = f"{self.directory}/{step}"
        state = _read_json(manager, step)

        saved_gbs = state.get("global_batch_size")
        if (
            global_batch_size is not None
            and saved_gbs is not None
            and int(saved_gbs) != int(global_batch_size)
            and not allow_batch_size_change
        ):
            raise CheckpointError(
                f"{where}: saved with global batch size {saved_gbs} but restoring with "
                f"{global_batch_size}; pass allow_batch_size_change=True to accept"
            )
        saved_mesh = MeshShape(**state["mesh"]) if isinstance(state.get("mesh"), dict) else None
        target_mesh, target_devices = _mesh_of_tree(target_params)
        topology = TopologyChange(
            saved_mesh=saved_mesh,
            target_mesh=target_mesh,
            saved_devices=saved_mesh.size if saved_mesh else None,
            target_devices=target_devices,
            saved_global_batch_size=None if saved_gbs is None else int(saved_gbs),
            target_global_batch_size=global_batch_size,
            consumed_samples=state.get("consumed_samples"),
        )

        targets = {PARAMS: target_params}
        if target_opt_state is not None:
            targets[OPT_STATE] = target_opt_state
        metas, missing, unexpected = {}, set(), set()
        for item, target in targets.items():
            meta = _item_metadata(manager, step, item)
            if meta is None:
                raise CheckpointError(
                    f"{where}: has no {item} (saved without it); restore with target_{item}=None"
                )
            miss, extra = _check_tree(f"{where}/{item}", meta, target, strict)
            metas[item] = meta
            missing |= {f"{item}.{k}" for k in miss}
            unexpected |= {f"{item}.{k}" for k in extra}

        if missing or unexpected:
            step_dir = self.directory / str(step)
            out = {k: _restore_partial(step_dir, k, metas[k], t) for k, t in targets.items()}
        else:
            args = {k: ocp.args.StandardRestore(t) for k, t in targets.items()}
            out = manager.restore(step, args=ocp.args.Composite(**args))
        return Restored(
            step=step,
            params=out[PARAMS],
            opt_state=out[OPT_STATE] if OPT_STATE in targets else None,
            trainer_state=state,
            topology=topology,
            missing_keys=tuple(sorted(missing)),
            unexpected_keys=tuple(sorted(unexpected)),
        )


# ----------------------------------------------------------------------------- one-shot helpers


def list_steps(directory: str | os.PathLike) -> list[int]:
    """Finalised steps under `directory` (empty when there is no such directory)."""
    if not Path(directory).is_dir():
        return []
    return sorted(int(s) for s in _read_only_manager(directory).all_steps())


def latest_step(directory: str | os.PathLike) -> int | None:
    steps = list_steps(directory)
    return steps[-1] if steps else None


def read_trainer_state(directory: str | os.PathLike, step: int | None = None) -> dict:
    """The trainer_state JSON of `step` (default: latest); reads no arrays."""
    manager = _read_only_manager(directory)
    return _read_json(manager, _resolve_step(manager, step))


def load_params_metadata(directory: str | os.PathLike, step: int | None = None) -> Any:
    """Saved params as a tree of `jax.ShapeDtypeStruct` (shape, dtype; no sharding), from the
    Orbax metadata only. Feed it to `abstract_tree` with target shardings to restore."""
    manager = _read_only_manager(directory)
    step = _resolve_step(manager, step)
    meta = _item_metadata(manager, step, PARAMS)
    if meta is None:
        raise CheckpointError(f"{manager.directory}/{step}: has no {PARAMS}")
    return _as_shape_dtype(meta)


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    params: Any,
    opt_state: Any = None,
    trainer_state: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
    trainer_state_after: Callable[[], Mapping[str, Any]] | None = None,
) -> Path:
    """Write a one-step checkpoint root at `directory`, atomically.

    Leaves of `params` / `opt_state` may be `hybridckpt.stream.LazyLeaf`s: those are read and
    written tile by tile (the streaming save; peak memory a few tiles, not the tree).
    `trainer_state_after()`, when given, is called on every process once all arrays are
    written (it may run collectives) and its keys are added to the saved trainer state: how an
    import records the checksums of the arrays it streamed.

    Everything is written into a temporary sibling `.<name>.tmp-<id>` and renamed into place
    once complete, so `directory` never holds a half-written checkpoint. A non-empty
    `directory` is refused unless `overwrite=True` (then it is replaced, also by rename).
    Under `jax.distributed` every process calls this with the same arguments: they write one
    checkpoint into one temporary directory (its name agreed through a barrier) and process 0
    renames it. Returns the absolute path.
    """
    dst = Path(directory).absolute()
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise CheckpointError(f"{dst}: exists and is not empty; pass overwrite=True to replace it")
    multi = jax.process_count() > 1
    primary = jax.process_index() == 0
    token = _shared_token() if multi else uuid.uuid4().hex[:8]
    tmp = dst.parent / f".{dst.name}.tmp-{token}"
    old = dst.parent / f".{dst.name}.old-{token}"
    if primary:
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{dst}: cannot create its folder: {e.strerror or e}") from e
    _barrier(f"hybridckpt-save-start-{token}")
    try:
        with CheckpointStore(tmp, async_save=False) as store:
            store.save(step, params, opt_state, trainer_state, force=True)
        if trainer_state_after is not None:
            extra = dict(trainer_state_after())
            if primary:
                _add_to_trainer_state(tmp / str(step), extra)
        _barrier(f"hybridckpt-save-done-{token}")
        if primary:
            if dst.is_dir() and any(dst.iterdir()):
                os.rename(dst, old)
            os.replace(tmp, dst)  # atomic; replaces an empty directory on POSIX
        _barrier(f"hybridckpt-save-renamed-{token}")
    except BaseException as e:
        if primary:
            _remove_tree(tmp)
            if old.exists() and not dst.exists():
                os.rename(old, dst)
        reason = _io_reason(e)
        if reason is not None:
            raise CheckpointError(f"{dst}: cannot write the checkpoint: {reason}") from e
        raise
    if primary:
        shutil.rmtree(old, ignore_errors=True)
    return dst


def _remove_tree(path: Path, tries: int = 50) -> None:
    """Remove `path`, again while writes still in flight (TensorStore threads after a failed
    save) put files back into it; gives up after about `tries` x 0.1 s."""
    import time

    for _ in range(tries):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            time.sleep(0.1)  # a late writer may recreate it: look once more
            if not path.exists():
                return
        time.sleep(0.1)


def _io_reason(e: BaseException) -> str | None:
    """The OS reason of a failed write (disk full, read-only, permissions), from an OSError or
    from TensorStore's errors as Orbax raises them (`... [os_error_code='28']`); else None."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = str(e)
    if isinstance(e, ValueError | RuntimeError) and "os_error_code=" in text:
        code = text.split("os_error_code=", 1)[1].strip("'\"[] \n").split("'")[0]
        if code.isdigit():
            return f"{os.strerror(int(code))} ({text.splitlines()[0][:300]})"
        return text.splitlines()[0][:300]
    return None


def _add_to_trainer_state(step_dir: Path, extra: Mapping[str, Any]) -> None:
    """Rewrite a (not yet renamed) step's trainer_state JSON with `extra` keys added, through
    Orbax's JSON handler so the item stays what `JsonRestore` reads."""
    item = step_dir / TRAINER_STATE
    handler = ocp.JsonCheckpointHandler()
    state = dict(handler.restore(item, args=ocp.args.JsonRestore()))
    state.update(extra)
    handler.save(item, args=ocp.args.JsonSave(state))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _shared_token() -> str:
    """A random token that every process of a jax.distributed job agrees on (process 0's)."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(uuid.uuid4().bytes[:8], dtype=np.uint32)
    agreed = multihost_utils.broadcast_one_to_all(mine)
    return "".join(f"{int(x):08x}" for x in np.asarray(agreed))
