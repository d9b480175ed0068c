"""One-shot atomic save of a one-step checkpoint root, also under `jax.distributed`.

Everything is written into a temporary sibling `.<name>.tmp-<id>` and renamed into place once
complete, so the destination never holds a half-written checkpoint; a failed write (disk full,
read-only, permissions) is one CheckpointError naming the OS reason and leaves the previous
contents.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from hybridckpt.errors import CheckpointError
from hybridckpt.store.layout import TRAINER_STATE
from hybridckpt.store.manager import CheckpointStore


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

    Leaves of `params` / `opt_state` may be `hybridckpt.store.stream.LazyLeaf`s: those are read and
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
        raise CheckpointError(f"{dst}: exists and is not empty; pass --overwrite (overwrite=True) to replace it")
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
        with CheckpointStore(tmp, async_save=False) as store, _no_cyclic_gc():
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


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic GC off while the arrays stream (back on after, as it was): JAX's heap is
    large, so each full collection walks it while the reader threads wait on the GIL (6-8% of
    an import's CPU samples by `perf`; a few % of its wall time in A/B runs). The save makes
    little cyclic garbage; it is collected once the GC is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
