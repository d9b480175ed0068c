"""One-shot atomic save of a one-step checkpoint root, also under `jax.distributed`.

Everything is written into a temporary sibling `.<name>.tmp-<id>` and renamed into place once
complete (`writers.destination`), so the destination never holds a half-written checkpoint; a failed
write (disk full, read-only, permissions) is one CheckpointError naming the OS reason and leaves
the previous contents.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from hybridckpt.errors import CheckpointError, ConfigError, HybridCkptError
from hybridckpt.io import byte_source, model_files, timing
from hybridckpt.io.gc_pause import gc_paused
from hybridckpt.io.model_files import ModelFile
from hybridckpt.io.paths import given
from hybridckpt.store.layout import HF_FILES, TRAINER_STATE
from hybridckpt.store.manager import CheckpointStore
from hybridckpt.writers.destination import Destination, io_reason


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    params: Any,
    opt_state: Any = None,
    trainer_state: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
    trainer_state_after: Callable[[], Mapping[str, Any]] | None = None,
    sources: Iterable[str | os.PathLike] = (),
    files: Iterable[ModelFile] = (),
) -> Path | str:
    """Write a one-step checkpoint root at `directory`, atomically.

    Leaves of `params` / `opt_state` may be `hybridckpt.store.stream.LazyLeaf`s: those are read and
    written tile by tile (the streaming save; peak memory a few tiles, not the tree).
    `trainer_state_after()`, when given, is called on every process once all arrays are
    written (it may run collectives) and its keys are added to the saved trainer state: how an
    import records the checksums of the arrays it streamed.

    Everything is written into a temporary sibling `.<name>.tmp-<id>` and renamed into place
    once complete, so `directory` never holds a half-written checkpoint (`writers.destination`: the
    lock against a second job, the checks against `sources`, what an interrupt leaves). A
    non-empty `directory` is refused unless `overwrite=True` (then it is replaced, also by rename).
    Under `jax.distributed` every process calls this with the same arguments: they write one
    checkpoint into one temporary directory (its name agreed through a barrier) and process 0
    renames it. Returns the absolute path.

    An object-storage URL (`s3://bucket/prefix`, `gs://...`) is written the same way into a local
    spool (`tempfile`'s folder) and uploaded by `writers.remote.RemoteDestination`: the staging
    marker first; each raw chunk file as soon as it is written, then removed from the spool (the
    spool holds the chunks in flight, not the step; the OCDBT databases of compressed LazyLeafs are
    written by TensorStore to the bucket itself, `io.remote.ts_writes`); the metadata files at the commit; the commit marker last
    (readers require it); a failure deletes what was uploaded; `overwrite` replaces only a prefix
    hybridckpt wrote. Under `jax.distributed` each process spools and uploads the chunks it
    writes itself (a compressed import's OCDBT databases: its TensorStore writes its own
    `ocdbt.process_<i>/` to the bucket, process 0 merges them there), process 0 writes the markers
    once every process agrees (`writers.remote_shared`); LazyLeafs only there. Returns the URL.
    """
    url = remote_url(directory)
    dst = str(url) if url is not None else Path(given(directory, "the destination")).absolute()
    multi = jax.process_count() > 1
    primary = jax.process_index() == 0
    token = _shared_token() if multi else uuid.uuid4().hex[:8]
    if url is not None and multi:
        _refuse_tensorstore_chunks(url, params, opt_state)
        from hybridckpt.store.processes import JaxProcesses
        from hybridckpt.writers.remote_shared import SharedRemoteDestination

        dest = SharedRemoteDestination(url, overwrite=overwrite, sources=sources, token=token, group=JaxProcesses(),
                                       tree=f"{step}/")
    else:
        dest = Destination(dst, overwrite=overwrite, sources=sources, primary=primary, token=token)
    try:
        with dest as tmp_name:
            tmp = Path(tmp_name)
            _barrier(f"hybridckpt-save-start-{token}")
            # Orbax's records and commit: the moments of the save no worker's stage covers (`io.timing`);
            # the cyclic GC off meanwhile (JAX's heap is large: each full pass walks it while the readers
            # wait on the GIL, 6-8% of an import's CPU samples; the save makes little cyclic garbage)
            with timing.stage("metadata", fallback=True), CheckpointStore(tmp, async_save=False) as store, \
                    gc_paused(), _spooled_apart(url is not None and multi):
                store.save(step, params, opt_state, trainer_state, force=True)
            with timing.stage("checksum"):  # the tables of the chunks' CRC-32s (gathered across processes)
                extra = dict(trainer_state_after()) if trainer_state_after is not None else {}
            files = list(files)
            if primary and files:
                folder = tmp / str(step) / HF_FILES
                folder.mkdir()
                extra[HF_FILES] = model_files.write(str(folder), files)
            if primary and extra:
                with timing.stage("metadata"):
                    _add_to_trainer_state(tmp / str(step), extra)
            if multi and url is None:  # (a bucket's processes agree in its commit: `writers.remote_shared`)
                _agree_sources_unchanged(dst)
            _barrier(f"hybridckpt-save-done-{token}")
            dest.commit()
            _barrier(f"hybridckpt-save-renamed-{token}")
    except BaseException as e:
        reason = io_reason(e, detail=True)
        if reason is not None:
            raise CheckpointError(f"{dst}: cannot write the checkpoint: {reason}") from e
        raise
    return dst


def preflight(directory: str | os.PathLike, *, overwrite: bool = False, sources: Iterable = ()) -> None:
    """The destination's checks (`Destination.preflight`: the sources, what is there) before a job
    reads anything, made by process 0; under `jax.distributed` every process learns the outcome
    (`store.processes.JaxProcesses.gather`), so a refusal is one line on every process, not one
    process's error while the others wait for it in the save's collectives."""
    mine = None
    if jax.process_index() == 0:
        try:
            Destination(directory, overwrite=overwrite, sources=sources).preflight()
        except HybridCkptError as e:
            if jax.process_count() == 1:
                raise
            mine = e
    if jax.process_count() == 1:
        return
    from hybridckpt.store.processes import JaxProcesses

    first = JaxProcesses().gather(None if mine is None else [str(mine), mine.cli_message])[0]
    if mine is not None:
        raise mine
    if first is not None:
        raise CheckpointError(f"{first[0][:400]} (checked by process 0)", cli=f"{first[1][:400]} (checked by process 0)")


def remote_url(directory: object):
    """The `RemoteUrl` `directory` names (a save to object storage, see `save_checkpoint`), or None."""
    from hybridckpt.io.remote.urls import parse

    return parse(directory)


def _refuse_tensorstore_chunks(url: object, params: Any, opt_state: Any) -> None:
    """A ConfigError for a tree without `LazyLeaf`s (an import's arrays are): those write raw chunk
    files each process uploads, or OCDBT databases each process's TensorStore writes to the
    bucket itself (`io.remote.ts_writes`), which process 0 merges there. Arrays of a training loop
    (Orbax's own handlers) would write each process's sub-database into that process's own
    spool, which process 0's merge cannot see."""
    from hybridckpt.store.stream import LazyLeaf

    for tree in (params, opt_state):
        leaves = [] if tree is None else jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LazyLeaf))
        if tree is not None and not any(isinstance(x, LazyLeaf) for x in leaves):
            raise ConfigError(f"{url}: a store of in-memory arrays written to object storage from several "
                              f"processes (jax.distributed) is not supported: save it to a shared local folder")


@contextlib.contextmanager
def _spooled_apart(apart: bool) -> Iterator[None]:
    """While `apart`, each process saves into a spool of its own (`stream_orbax.SPOOLED_APART`)."""
    from hybridckpt.store.stream_orbax import SPOOLED_APART

    if not apart:
        yield
        return
    SPOOLED_APART.set()
    try:
        yield
    finally:
        SPOOLED_APART.clear()


def _add_to_trainer_state(step_dir: Path, extra: Mapping[str, Any]) -> None:
    """Rewrite a (not yet renamed) step's trainer_state JSON with `extra` keys added, through
    Orbax's JSON handler so the item stays what `JsonRestore` reads."""
    item = step_dir / TRAINER_STATE
    handler = ocp.JsonCheckpointHandler()
    state = dict(handler.restore(item, args=ocp.args.JsonRestore()))
    state.update(extra)
    handler.save(item, args=ocp.args.JsonSave(state))


def _agree_sources_unchanged(dst: object) -> None:
    """Under `jax.distributed`: every process checks the source files it read itself
    (`byte_source.check_watches`; process 0's commit sees only its own reads) and they agree
    before the commit: the process whose source changed raises its own one-line error, every
    other one a CheckpointError naming that process; nothing is committed."""
    from jax.experimental import multihost_utils

    try:
        byte_source.check_watches()
        mine = None
    except HybridCkptError as e:
        mine = e
    changed = np.asarray(multihost_utils.process_allgather(np.array([mine is not None], dtype=np.int32)))
    if mine is not None:
        raise mine
    if changed.any():
        who = ", ".join(str(i) for i in np.flatnonzero(changed.reshape(-1)))
        raise CheckpointError(f"{dst}: not committed: a source file read by process {who} changed while it "
                              f"was read (that process's error names it)")


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
