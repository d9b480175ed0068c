"""The Orbax plumbing of our store: the handler registry, read-only managers, item metadata,
the trainer-state JSON, tree checks against a target and partial restores.

Items (see `store.layout`): `params` and `opt_state` are written by
`store.stream_orbax.StreamingCheckpointHandler` (Orbax's StandardCheckpointHandler that also streams
`stream.LazyLeaf` leaves), `trainer_state` by Orbax's JSON handler. Orbax's info/warning chatter
(logged through absl) is dropped; its errors are kept, except its log of an exception a
background thread raised (the same exception reaches the caller, which reports it once), and the
"Event loop is closed" that TensorStore's late completions of a failed save print and the warning
of a write coroutine such a save never ran.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from hybridckpt.errors import CheckpointError
from hybridckpt.store.layout import (
    OPT_STATE,
    PARAMS,
    TRAINER_STATE,
    flat_leaves,
    has_shape,
    leaf_key,
    short_list,
)


class _QuietOrbax(logging.Filter):
    """Drop Orbax's info/warning chatter (it logs through absl) and its log of an exception in
    one of its threads (`_SignalingThread.run() raised an exception`, with a traceback: Orbax
    keeps the exception and raises it in the caller, which reports it); keep its other errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        return record.levelno >= logging.ERROR and "_SignalingThread.run() raised" not in str(record.msg)


if not any(isinstance(f, _QuietOrbax) for f in logging.getLogger("absl").filters):
    logging.getLogger("absl").addFilter(_QuietOrbax())


def _late_completions_dropped(hook):
    """`sys.unraisablehook` that drops "RuntimeError: Event loop is closed": after a save fails,
    Orbax closes its event loop while TensorStore writes it started are still in flight; their
    completions then call into the closed loop from TensorStore's threads, which print it
    (unraisable) once per write, at exit after the one-line error. Nothing waits for them."""

    def unraisable(u) -> None:
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        hook(u)

    unraisable.drops_late_completions = True
    return unraisable


if not getattr(sys.unraisablehook, "drops_late_completions", False):
    sys.unraisablehook = _late_completions_dropped(sys.unraisablehook)

class _FullDiskSiblings(logging.Filter):
    """Drop asyncio's "Future exception was never retrieved" when that exception is the disk being
    full (ENOSPC, EFBIG): a save on a full disk fails several TensorStore writes at once; Orbax's
    gather raises the first (the caller reports it, one line) and the others' futures are
    collected unretrieved, logged with a traceback at exit (CI, `test_crash_safety`'s
    `maxtext-16k`, now and then). Any other unretrieved exception is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "never retrieved" not in str(record.msg):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{record.getMessage()} {exc}"
        return not any(s in text for s in ("No space left on device", "File too large"))


if not any(isinstance(f, _FullDiskSiblings) for f in logging.getLogger("asyncio").filters):
    logging.getLogger("asyncio").addFilter(_FullDiskSiblings())

# the same failed save can leave a write coroutine it created but never ran (Orbax's
# `async_serialize_from_host.<locals>.write_fragment`); Python warns of it when it is collected, at
# exit after the one-line error (seen on a full disk, now and then). Nothing was to run it.
warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


def handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    from hybridckpt.store.stream_orbax import StreamingCheckpointHandler

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


def standard_save(tree: Any) -> ocp.args.StandardSave:
    """StandardSave of a tree of jax.Arrays and/or `stream.LazyLeaf`s (the latter with their
    chunking SaveArgs: written tile by tile, see `hybridckpt.store.stream`)."""
    from hybridckpt.store import stream

    if stream.has_lazy(tree):
        return ocp.args.StandardSave(tree, save_args=stream.save_args(tree))
    return ocp.args.StandardSave(tree)


def read_only_manager(directory: str | os.PathLike) -> ocp.CheckpointManager:
    path = Path(directory).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint directory there")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(path, options=options, handler_registry=handler_registry())


def resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
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


def items_metadata(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """Every item's saved tree of Orbax ArrayMetadata in `step` (item name -> tree; an item
    without a tree is left out). One read of the step's metadata: Orbax's `metadata(step)` reads
    every item's each time it is called (20-30 ms on the 2-core VM for a store's params, AdamW state
    and trainer state), so a caller that wants two items asks once (`CheckpointStore`)."""
    meta = manager.metadata(step).item_metadata
    if meta is None:
        return {}
    return {name: t.tree for name in meta if (t := meta.get(name)) is not None and hasattr(t, "tree")}


def item_metadata(manager: ocp.CheckpointManager, step: int, item: str) -> Any | None:
    """The saved tree of Orbax ArrayMetadata for `item`, or None when the step lacks it."""
    return items_metadata(manager, step).get(item)


def as_shape_dtype(meta_tree: Any) -> Any:
    return jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)),
        meta_tree,
        is_leaf=has_shape,
    )


def read_json(manager: ocp.CheckpointManager, step: int) -> dict:
    out = manager.restore(step, args=ocp.args.Composite(trainer_state=ocp.args.JsonRestore()))
    state = out[TRAINER_STATE]
    if not isinstance(state, dict):
        raise CheckpointError(f"{manager.directory}/{step}/{TRAINER_STATE}: not a JSON object")
    return state


def check_tree(
    where: str, saved_meta: Any, target: Any, strict: bool
) -> tuple[set[str], set[str]]:
    """Compare a saved tree (Orbax metadata) with an abstract target; returns (missing,
    unexpected) key sets. Shapes must agree; keys must agree when `strict`."""
    saved, wanted = flat_leaves(saved_meta), flat_leaves(target)
    missing, unexpected = set(wanted) - set(saved), set(saved) - set(wanted)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {short_list(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the target: {short_list(unexpected)}")
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
    return wanted.get(leaf_key(prefix))


def restore_partial(step_dir: Path, item: str, saved_meta: Any, target: Any) -> Any:
    """Restore the keys common to the saved tree and `target`; missing leaves stay abstract."""
    _, treedef = jax.tree_util.tree_flatten(target, is_leaf=has_shape)
    wanted = flat_leaves(target)
    sub = _partial_item(saved_meta, wanted)
    got: dict[str, Any] = {}
    if sub is not None:
        args = ocp.args.PyTreeRestore(
            item=sub,
            restore_args=ocp.checkpoint_utils.construct_restore_args(sub),
            partial_restore=True,
        )
        with ocp.PyTreeCheckpointer() as checkpointer:
            got = flat_leaves(checkpointer.restore(step_dir / item, args=args))
    leaves = [got.get(key, leaf) for key, leaf in wanted.items()]
    return jax.tree_util.tree_unflatten(treedef, leaves)



def list_steps(directory: str | os.PathLike) -> list[int]:
    """Finalised steps under `directory` (empty when there is no such directory)."""
    if not Path(directory).is_dir():
        return []
    return sorted(int(s) for s in read_only_manager(directory).all_steps())


def latest_step(directory: str | os.PathLike) -> int | None:
    steps = list_steps(directory)
    return steps[-1] if steps else None


def read_trainer_state(directory: str | os.PathLike, step: int | None = None) -> dict:
    """The trainer_state JSON of `step` (default: latest); reads no arrays."""
    manager = read_only_manager(directory)
    return read_json(manager, resolve_step(manager, step))


def load_params_metadata(directory: str | os.PathLike, step: int | None = None) -> Any:
    """Saved params as a tree of `jax.ShapeDtypeStruct` (shape, dtype; no sharding), from the
    Orbax metadata only. Feed it to `abstract_tree` with target shardings to restore."""
    manager = read_only_manager(directory)
    step = resolve_step(manager, step)
    meta = item_metadata(manager, step, PARAMS)
    if meta is None:
        raise CheckpointError(f"{manager.directory}/{step}: has no {PARAMS}")
    return as_shape_dtype(meta)


ORBAX_THREADS_JOIN_S = 60.0  # seconds a failed save waits at most for the threads Orbax left running


def join_orbax_threads(running: set, timeout_s: float = ORBAX_THREADS_JOIN_S) -> None:
    """Join the threads of Orbax's (`orbax.*` classes) started since `running` (the threads alive
    before a save) and still alive: a save that failed returns while they run. Orbax writes each
    item's `_METADATA` in a thread of its own once the item's writes are committed
    (`write_metadata_after_commits`); one item's failure ended the save while another item's
    thread was still to write, and its `_METADATA` landed after the job had removed what it wrote
    (a bucket import's spool, a local import's temporary folder), re-creating the folders (CI,
    `test_store_s3_spool`, on a loaded machine)."""
    import threading
    import time

    deadline = time.monotonic() + max(0.0, timeout_s)
    for t in threading.enumerate():
        if t in running or t is threading.current_thread() or not type(t).__module__.startswith("orbax."):
            continue
        t.join(max(0.0, deadline - time.monotonic()))

