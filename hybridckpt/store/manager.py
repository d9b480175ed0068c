"""`CheckpointStore`: Orbax's CheckpointManager over our items, for training loops and jobs.

Save intervals, keep-N, keep-best, async saves and an optional optimizer item; restore onto any
mesh from abstract targets (`plan.abstract_tree`), with a report of what changed in the topology,
a refused change of global batch size unless overridden, and strict missing/unexpected keys.
The on-disk layout and trainer-state keys are described in `store.layout`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from hybridckpt.containers.orbax.declared import check_orbax_tree
from hybridckpt.errors import CheckpointError, ConfigError
from hybridckpt.io import timing
from hybridckpt.io.paths import given
from hybridckpt.mesh import MeshShape
from hybridckpt.store import bucket_restore, orbax_io
from hybridckpt.store.checked import CRC_TABLES, has_crc_tables
from hybridckpt.store.layout import (
    HF_FILES,
    OPT_STATE,
    PARAMS,
    TRAINER_STATE,
    Restored,
    TopologyChange,
    leaf_key,
    mesh_of_tree,
    rng_to_json,
    short_list,
)
from hybridckpt.store.orbax_io import (
    as_shape_dtype,
    check_tree,
    handler_registry,
    items_metadata,
    read_json,
    resolve_step,
    restore_partial,
    standard_save,
)
from hybridckpt.store.read_item import read_items
from hybridckpt.store.save_crcs import crc_record

# what an import records about the arrays it wrote: a later save writes other arrays, so a
# trainer state carried over from a restore must not bring them along
IMPORT_CHECKSUM_KEYS = ("checksums", "checksum_chunks", "checksum_algorithm", CRC_TABLES, "array_specs")
# (and the files it kept beside them, `<step>/hf_files/`, which a later save does not copy)
IMPORT_KEYS = (*IMPORT_CHECKSUM_KEYS, HF_FILES)


def _metric(name: str, metrics: Mapping[str, float]) -> float:
    return float(metrics[name])


def _unwrapped(where: str, what: str, fn):
    """`fn()`, with Orbax's and TensorStore's own errors (a damaged metadata file) turned into one
    CheckpointError naming `what` could not be read."""
    try:
        return fn()
    except (ValueError, RuntimeError, OSError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: cannot read {what}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    """An Orbax / TensorStore error's first line, without the spec it appends."""
    text = str(e).split(" [source locations=")[0].split(" [tensorstore_spec=")[0]
    return f"{type(e).__name__}: {' '.join(text.split())[:300]}"


def _check_item(tree: Any, where: str) -> None:
    """Every leaf's joined key is one safe folder name inside the item (`containers.orbax.keys`),
    and the item is written by one Orbax type handler: streamed leaves (`stream.LazyLeaf`) and
    `jax.Array`s in one item are a ConfigError. Each handler records its arrays in the item's
    `array_metadatas/process_0` by a read-modify-write with an await between, in one event loop:
    the later write dropped the other's records and Orbax's commit failed ("No ArrayMetadata
    found for ...", as the MaxText export's step counters did, 40292ab). Wrapping the arrays as
    lazy leaves instead would leave them out of the CRC tables a caller records from its own
    leaves (`jobs.import_`)."""
    from hybridckpt.containers.orbax.keys import check_leaf_key
    from hybridckpt.store.stream import LazyLeaf

    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, LazyLeaf))
    kinds: dict[bool, list[str]] = {True: [], False: []}
    for path, leaf in flat:
        check_leaf_key(leaf_key(path), where)
        if isinstance(leaf, LazyLeaf | jax.Array):
            kinds[isinstance(leaf, LazyLeaf)].append(leaf_key(path))
    if kinds[True] and kinds[False]:
        raise ConfigError(f"{where}: mixes streamed leaves (stream.LazyLeaf: {short_list(set(kinds[True]), 4)}) "
                          f"and jax.Arrays ({short_list(set(kinds[False]), 4)}); Orbax records the two kinds' "
                          f"arrays apart and loses some: give the item leaves of one kind")


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
        _refuse_url(directory)  # (never a local folder named `s3:`)
        self.directory = Path(given(directory, "the store's folder")).absolute()
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
        self._own_items: dict[tuple[int, str], bucket_restore.BucketItem | None] = {}
        self._metadata: dict[tuple[int, str], Any] = {}  # (step, item) -> Orbax's metadata tree, read once
        self._states: dict[int, dict] = {}  # step -> its trainer state, read once (callers get copies)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=handler_registry()
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
        """The trainer state of `step` (default: latest), a copy of the caller's own."""
        self._manager.wait_until_finished()
        return copy.deepcopy(self._state(resolve_step(self._manager, step)))

    def _state(self, step: int) -> dict:
        """The trainer state of `step` as read once for this store's life (a save forgets it): a
        restore asks twice, its plan (`jobs.restore`) then `restore` itself, and each read was an
        Orbax restore of the item, its CRC tables included. Not to be changed: hand out copies."""
        if step not in self._states:
            self._states[step] = _unwrapped(f"{self.directory}/{step}", "its trainer state",
                                            lambda: read_json(self._manager, step))
        return self._states[step]

    def params_metadata(self, step: int | None = None) -> Any:
        """Saved params as a tree of `jax.ShapeDtypeStruct` (no sharding); reads no arrays."""
        self._manager.wait_until_finished()
        step = resolve_step(self._manager, step)
        return as_shape_dtype(self._item_tree(step, PARAMS))

    def opt_state_metadata(self, step: int | None = None) -> Any:
        """The saved optimizer state as a tree of `jax.ShapeDtypeStruct` (Orbax's own nesting:
        lists and dicts), or None when the step has none; reads no arrays."""
        self._manager.wait_until_finished()
        step = resolve_step(self._manager, step)
        meta = self._item_tree(step, OPT_STATE)
        return None if meta is None else as_shape_dtype(meta)

    def _item_tree(self, step: int, item: str) -> Any:
        """`item`'s tree with a shape and dtype per array (None when the step lacks it), as our
        reader builds it (`store.bucket_restore.open_item`: `_METADATA` and the arrays' own
        metadata, the arrays opened once for the restore that follows) where it reads the item,
        else Orbax's (`_item_metadata`; a leaf only Orbax reads). The trees are equal where both
        read it (tests/store/test_bucket_restore.py); ours skips Orbax's metadata pass over every
        item of the step (10-20 ms of a restore's serial start on the 2-core VM, issue 42)."""
        opened = self._own_item(step, item)
        return opened.tree if opened is not None else self._item_metadata(step, item)

    def _item_metadata(self, step: int, item: str) -> Any:
        """Orbax's metadata tree of `item` (None when the step lacks it); for a store in a bucket
        (a view, `io.remote.view`) built by our reader from the bucket (`store.bucket_restore`:
        Orbax would read the view's placeholders)."""
        where = f"{self.directory}/{step}"
        if bucket_restore.in_bucket(str(self.directory)):
            opened = self._own_item(step, item)
            return None if opened is None else opened.tree
        key = (step, item)  # (a restore asks for the params' twice, and the optimizer state's: read once)
        if key not in self._metadata:  # every item of the step at once: Orbax reads them all for any one
            trees = _unwrapped(where, f"the metadata of {item}", lambda: items_metadata(self._manager, step))
            for name, tree in trees.items():
                self._metadata.setdefault((step, name), tree)
            self._metadata.setdefault(key, None)
        return self._metadata[key]

    def _own_item(self, step: int, item: str) -> bucket_restore.BucketItem | None:
        """`item` of `step` opened by our reader once for this store's metadata and restores (in
        a bucket: its OCDBT index and arrays' metadata read from the bucket once). None where the
        step lacks it, and for a local item our reader refuses (a leaf only Orbax reads, or
        metadata it finds wrong: Orbax then reads it, or names what is wrong its own way)."""
        key = (step, item)
        if key not in self._own_items:
            try:
                self._own_items[key] = bucket_restore.open_item(os.path.join(f"{self.directory}/{step}", item))
            except CheckpointError:
                if bucket_restore.in_bucket(str(self.directory)):
                    raise
                self._own_items[key] = None
        return self._own_items[key]

    def _opened(self, step: int, item: str) -> dict | None:
        """The arrays of `item` as our reader opened them for its metadata (`_own_item`), else None."""
        opened = self._own_items.get((step, item))
        return None if opened is None else opened.arrays

    # -- save
    def _trainer_json(self, step: int, params: Any, trainer_state: Mapping | None) -> dict:
        state = {k: v for k, v in (trainer_state or {}).items() if k not in IMPORT_KEYS}
        if "step" in state and int(state["step"]) != step:
            raise CheckpointError(
                f"{self.directory}: trainer_state['step']={state['step']} but saving step {step}"
            )
        state["step"] = int(step)
        if "mesh" not in state:
            mesh, _ = mesh_of_tree(params)
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
        `mesh` (taken from the params' shardings) filled in, and the CRC-32 of every chunk of
        every array (`store.save_crcs`), against which restore, export and verify check it. A step that already exists is an
        error.
        """
        if not force and not self._manager.should_save(step):
            return False
        self._metadata.clear()  # (a step the policy removes may be saved again under its number)
        self._own_items.clear()
        self._states.clear()
        state = self._trainer_json(step, params, trainer_state)
        _check_item(params, f"{self.directory}/{step}/{PARAMS}")
        if opt_state is not None and self.save_optimizer:
            _check_item(opt_state, f"{self.directory}/{step}/{OPT_STATE}")
        trees = {PARAMS: params}
        if opt_state is not None and self.save_optimizer:
            trees[OPT_STATE] = opt_state
        state.update(crc_record(trees, state) or {})  # every later read checked, as an import's
        items: dict[str, Any] = {k: standard_save(t) for k, t in trees.items()}
        items[TRAINER_STATE] = ocp.args.JsonSave(state)
        running = set(threading.enumerate())
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
        except BaseException:
            orbax_io.join_orbax_threads(running)  # (before the job removes what it wrote)
            raise

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
        verify_reads: bool = True,
    ) -> Restored:
        """Restore `step` (default: latest) onto the shardings carried by the targets.

        target_params / target_opt_state: trees of `jax.ShapeDtypeStruct` with `.sharding`
          (see `abstract_tree`); `target_opt_state=None` skips the optimizer state.
        global_batch_size: the new run's batch size; a change from the saved one is refused
          unless `allow_batch_size_change`.
        strict: missing / unexpected keys are an error; with False the common keys are
          restored and the others reported in `Restored.missing_keys / unexpected_keys`.
        verify_reads: a step whose import recorded CRC-32s per chunk is read through them
          (`store.checked`: every chunk checked, each device reading the chunks of its shard);
          a training loop's save records them too (`store.save_crcs`); False, or a step
          without them, is read by Orbax (a store in a bucket by our reader, unchecked:
          `store.bucket_restore`).
        """
        manager = self._manager
        manager.wait_until_finished()  # a pending async save must be on disk before reading
        step = resolve_step(manager, step)
        where = f"{self.directory}/{step}"
        with timing.stage("metadata"):
            state = self._state(step)  # (read once a step; `Restored` gets a copy)

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
        target_mesh, target_devices = mesh_of_tree(target_params)
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
        step_dir = self.directory / str(step)
        checked = verify_reads and has_crc_tables(state, where)
        ours = checked or bucket_restore.in_bucket(str(step_dir))  # (Orbax would read a bucket's view as zeros)
        metas, missing, unexpected = {}, set(), set()
        for item, target in targets.items():
            with timing.stage("metadata"):  # (read by our reader: `_item_tree`; by Orbax: its metadata)
                meta = self._item_tree(step, item) if ours else self._item_metadata(step, item)
            if meta is None:
                raise CheckpointError(
                    f"{where}: has no {item} (saved without it); restore with target_{item}=None"
                )
            miss, extra = check_tree(f"{where}/{item}", meta, target, strict)
            with timing.stage("metadata"):  # before Orbax allocates what it declares
                check_orbax_tree(str(self.directory / str(step) / item), meta)
            metas[item] = meta
            missing |= {f"{item}.{k}" for k in miss}
            unexpected |= {f"{item}.{k}" for k in extra}

        try:
            if ours:
                out = read_items(str(step_dir), targets, state, verify=checked,
                                 found={k: self._opened(step, k) for k in targets})
            else:
                if missing or unexpected:
                    out = {k: restore_partial(step_dir, k, metas[k], t) for k, t in targets.items()}
                else:
                    args = {k: ocp.args.StandardRestore(t) for k, t in targets.items()}
                    with timing.stage("read", fallback=True):  # TensorStore's reads, in its own threads
                        out = manager.restore(step, args=ocp.args.Composite(**args))
        except (ValueError, RuntimeError, OSError, KeyError) as e:  # Orbax's and TensorStore's own
            raise CheckpointError(f"{where}: cannot restore: {_first_line(e)}") from e
        return Restored(
            step=step,
            params=out[PARAMS],
            opt_state=out[OPT_STATE] if OPT_STATE in targets else None,
            trainer_state=copy.deepcopy(state),
            topology=topology,
            missing_keys=tuple(sorted(missing)),
            unexpected_keys=tuple(sorted(unexpected)),
        )


def _refuse_url(directory: object) -> None:
    """A ConfigError when `directory` is an object-storage URL: a training loop's store, saved
    step after step and pruned in place, is a local or mounted folder (a one-step checkpoint goes
    to a bucket with `store.save.save_checkpoint` or `hybridckpt import`), never a folder named
    `s3:` in the working directory."""
    from hybridckpt.io.remote.urls import parse

    url = parse(directory)
    if url is not None:
        raise ConfigError(f"{url}: a CheckpointStore (saved step after step) lives in a local or mounted folder; "
                          f"a one-step checkpoint goes to object storage with save_checkpoint or "
                          f"hybridckpt import SRC {url}")
