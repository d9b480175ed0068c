"""The Orbax side of a streaming save: the type handler that writes `stream.LazyLeaf` leaves.

`LazyArrayHandler.serialize` follows Orbax 0.12.8's own `ArrayHandler.serialize`
(google/orbax:checkpoint/orbax/checkpoint/_src/serialization/jax_array_handlers.py,
`_async_serialize_replica_slices` and `serialization.async_serialize_from_host`):

1. the TensorStore spec and ArrayMetadata come from Orbax's `build_array_write_spec` (write
   shape = the shard shape, chunk shape from `SaveArgs(chunk_byte_size, shard_axes)`), the codec
   from `containers.orbax.codec`;
2. the primary process creates each zarr array (its `.zarray`), in order; where TensorStore
   writes the chunks every process then opens it with `assume_metadata`; raw chunk files need
   only their folder, so a raw item's arrays are created while its tiles are written;
3. the tiles of `stream.owned_tiles` (the process's shard boxes joined, then cut; planned leaf by
   leaf on the planner thread, `_planned_tiles`) are read by the reader pool (`stream.read_tile`) under the
   save's byte budget and written: raw chunks to their files by the writer pool (`_write_tile`;
   `containers.orbax.chunk_files`, then one syncfs an item), compressed ones through TensorStore
   (small tiles batched into shared OCDBT commits, `_SmallWrites`);
4. the array metadata is appended to `array_metadatas/process_<i>`; the shardings go to `_sharding`
   (Orbax's `_async_serialize_shardings`), for a raw item while its tiles are written, awaited
   with them before the item is committed (Orbax writes it first: that wait, before any read, was
   the longest of the save's start).

`StreamingCheckpointHandler` is `StandardCheckpointHandler` with that handler registered for
`LazyLeaf`: a save whose lazy leaves are all raw goes without OCDBT, any other with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

# The three Orbax internals still used (tests/store/test_orbax_private.py pins them; orbax-checkpoint 0.12):
# Validator: its cross-process check of the array records skipped while each process spools apart (`_Validator`)
from orbax.checkpoint._src.metadata import array_metadata_store

# _async_serialize_shardings: writes the item's `_sharding` record exactly as Orbax's own ArrayHandler does
from orbax.checkpoint._src.serialization import jax_array_handlers

# build_array_write_spec: the zarr spec and ArrayMetadata (chunk shape from SaveArgs) Orbax's save records
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from hybridckpt import checksum
from hybridckpt.containers.orbax import chunk_files
from hybridckpt.containers.orbax.codec import apply_codec, parse_compression
from hybridckpt.errors import CheckpointError
from hybridckpt.io import timing
from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.io.remote import ts_writes
from hybridckpt.io.remote.ts_kvstore import kvstore_spec
from hybridckpt.io.writeback import FilesystemSync, fsync_folder
from hybridckpt.lazy import Box, box_shape, parallel
from hybridckpt.store import stream
from hybridckpt.store.stream import LazyLeaf, StreamOptions, opts_of


def _all_raw_lazy(tree: Any) -> bool:
    """Whether `tree` has lazy leaves and all of them are written raw (codec "none")."""
    lazy = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LazyLeaf)) if isinstance(x, LazyLeaf)]
    return bool(lazy) and all(parse_compression((x.options or StreamOptions()).compression)[0] == "none" for x in lazy)


def _read_tile(leaf: LazyLeaf, box: Box, target: chunk_files.ChunkFiles, buffers: AlignedPool) -> tuple:
    """A tile read (`stream.read_tile`) into a buffer the save's pool lends: (it, its give-back)."""
    buf, give = buffers.borrow(box_shape(box), leaf.dtype)
    try:
        stream.read_tile(leaf, box, target.chunk, buf, False)
        return buf, give
    except BaseException:
        give()
        raise


def _write_tile(leaf: LazyLeaf, box: Box, target: chunk_files.ChunkFiles, buffers: AlignedPool,
                buf: np.ndarray, give: Callable[[], None]) -> None:
    """`_read_tile`'s tile written to its chunk files, each checksummed as written (`write_tile`'s
    `on_chunk`: a strip is copied out once), its buffer given back; in a writer thread
    (`parallel.write_pool`) while the readers read on. (A reader writing its own tile: the four
    fell into step, the disk idle while all read, 95-160 ms of a 2.9 s import of 4.4 GiB.)"""
    crcs: list[tuple[int, int]] = []

    def checksummed(sub: Box, elements: np.ndarray) -> None:
        with timing.stage("checksum", elements.nbytes):
            crcs.append((checksum.grid_index(leaf.shape, target.chunk, sub), checksum.crc32_of(elements)))

    try:
        chunk_files.write_tile(target, box, buf, checksummed, buffers)  # (a strip's copy: lent too)
    finally:
        give()
    leaf.add_crcs(crcs)


class LazyArrayHandler(ocp.type_handlers.ArrayHandler):
    """Orbax's ArrayHandler for `LazyLeaf` values: same files, data written tile by tile."""

    async def serialize(self, values, infos, args=None):  # noqa: D401 - see the module doc
        opts = opts_of(values)
        group = opts.budget()
        await group.enter()  # before any await: every item of the save is counted from the start
        try:
            specs = await self._write_all(values, infos, list(args or [ocp.SaveArgs()] * len(values)), opts)
        except BaseException as e:
            group.failed.append(e)
            # the other items of this save (params / opt_state) stop reading; wait for them so
            # no TensorStore or reader callback outlives the event loop Orbax closes on error
            await group.leave(wait=True)
            err = ts_writes.write_error(str(infos[0].parent_dir), e)  # (a bucket's: one line)
            if err is not e:
                raise err from None
            raise
        await group.leave()
        if self._array_metadata_store is not None:
            # (its folder made here too: Orbax's other processes wait for process 0 to make it, which
            # a process spooling apart for a bucket never sees: `writers.remote_shared`)
            store = self._array_metadata_store
            folder = store._path_resolver.get_write_file_path(infos[0].parent_dir, jax.process_index()).parent  # noqa: SLF001
            os.makedirs(folder, exist_ok=True)
            await self._array_metadata_store.write(
                checkpoint_dir=infos[0].parent_dir,
                array_metadatas=[s.metadata for s in specs],
                process_index=jax.process_index(),
            )
        return []

    async def _write_all(self, values, infos, args, opts: StreamOptions) -> list:
        for info in infos:
            await info.await_path_creation()
        use_ocdbt = bool(infos[0].is_ocdbt_checkpoint)
        pidx = jax.process_index() if use_ocdbt else None  # OCDBT: one sub-database per process
        specs = [
            ts_utils.build_array_write_spec(
                info, arg, global_shape=v.shape, local_shape=tuple(v.sharding.shard_shape(v.shape)),
                dtype=v.dtype, use_ocdbt=use_ocdbt, process_index=pidx, metadata_key=self._metadata_key,
            )
            for v, info, arg in zip(values, infos, args, strict=True)
        ]
        for spec in specs:
            apply_codec(spec, opts.compression)
            if use_ocdbt:  # into a bucket's spool: TensorStore writes the bucket itself (`io.remote.ts_writes`)
                ts_writes.to_bucket(_tensorstore_spec(spec.json)["kvstore"])
        primary = self._primary_host is None or self._primary_host == jax.process_index()
        targets = [
            None if use_ocdbt else chunk_files.target_of(spec.json, tuple(spec.metadata.chunk_shape),
                                                         direct=opts.direct_io)
            for spec in specs
        ]
        raw = all(t is not None for t in targets)
        # each array's metadata (its `.zarray`) created in order, by the primary process; raw
        # chunk files need only their folder, so a raw save writes while the metadata is created
        for target in targets:
            if target is not None:
                os.makedirs(target.folder, exist_ok=True)  # (another process may write first)
        batched = _filesystem_sync(targets) if opts.batched_sync else None
        if batched is not None:  # one syncfs for the item's chunk files, after the last (see below)
            targets = [None if t is None else dataclasses.replace(t, sync=False) for t in targets]
        # a raw item's `_sharding` record is written while its tiles are (awaited with them, before
        # Orbax commits the item): before, its JSON for every leaf was made and committed first, the
        # longest wait of the save's start (tens of ms of a 36-leaf import) with no reader busy
        shardings = _shardings_written(values, infos, self._primary_host, opts)
        if not raw:  # (first, as Orbax's own handler writes it)
            await shardings
            shardings = _nothing()
        creating = _create_arrays(specs, infos, fsync=batched is None) if primary else _nothing()
        stores: list = [None] * len(specs)
        if not raw:  # TensorStore writes the chunks: each array opened once it exists
            await creating
            creating = _nothing()
            for i, (spec, info, target) in enumerate(zip(specs, infos, targets, strict=True)):
                if target is None:
                    stores[i] = await ts.open(ts.Spec(spec.json), open=True, assume_metadata=True,
                                              context=info.ts_context)
        small = _SmallWrites(opts.small_batch_bytes())
        try:
            await _all(
                [
                    creating,
                    shardings,
                    *(self._write_leaf(v, store, tuple(spec.metadata.chunk_shape), small, opts, target)
                      for v, store, spec, target in zip(values, stores, specs, targets, strict=True)),
                ]
            )
            await small.commit()
            # before Orbax commits the item: every chunk file durable, its bytes, inode and name
            if batched is not None:
                batched.sync()  # one syncfs: every file written since it was opened (`io.writeback`)
            else:
                for target in targets:  # each file fsync'd as written; their names here
                    if target is not None:
                        fsync_folder(target.folder)
        except BaseException:
            small.abort()
            raise
        finally:
            if batched is not None:
                batched.close()
        return specs

    async def _write_leaf(
        self,
        leaf: LazyLeaf,
        store: ts.TensorStore | None,
        chunk: tuple[int, ...],
        small: _SmallWrites,
        opts: StreamOptions,
        target: chunk_files.ChunkFiles | None = None,
    ) -> None:
        budget = opts.budget()
        failed = budget.failed
        item = leaf.dtype.itemsize
        loop = asyncio.get_running_loop()
        # planned on the planner thread, leaf after leaf, while the readers write the tiles of
        # the leaves planned before (`_planned_tiles`), not in this event loop before any read
        tiles = await _in_pool(loop, _planned_tiles, leaf, chunk, opts, executor=_planner())
        leaf.checksum_chunk = tuple(chunk)

        async def one(box: Box) -> None:
            n = max(1, math.prod(box_shape(box)) * item)
            await budget.acquire(n)
            try:
                if failed:  # another tile failed: read nothing more
                    return
                if target is not None:  # raw chunks: read by a reader thread, written by a writer
                    async with budget.tiles:
                        lent = await _in_pool(loop, _read_tile, leaf, box, target, budget.buffers)
                        await _in_pool(loop, _write_tile, leaf, box, target, budget.buffers, *lent, executor=parallel.write_pool())
                else:
                    buf = await _in_pool(loop, stream.read_tile, leaf, box, chunk)
                    index = tuple(slice(a, b) for a, b in box)
                    if n < opts.small_tile_bytes():
                        await small.write(store, index, buf, n)
                    else:
                        await store[index].write(buf, can_reference_source_data_indefinitely=True)
                    del buf
                opts.stats.bytes_written += n
                opts.stats.tiles += 1
                opts.stats.largest_tile_bytes = max(opts.stats.largest_tile_bytes, n)
            except BaseException as e:
                failed.append(e)
                raise
            finally:
                await budget.release(n)

        await _all([one(b) for b in tiles])
        if opts.on_leaf is not None:
            opts.on_leaf(leaf.name, leaf.nbytes)


def _tensorstore_spec(json_spec: dict) -> dict:
    """The zarr spec of an Orbax write spec (inside its "cast" driver when it has one)."""
    return json_spec.get("base", json_spec) if json_spec.get("driver") == "cast" else json_spec


async def _merge_in_bucket(directory: str) -> None:
    """Orbax's `merge_ocdbt_per_process_files` for an item whose OCDBT databases TensorStore wrote
    to a bucket (`io.remote.ts_writes`): the per-process databases found there (`ocdbt.process_<i>/
    manifest.ocdbt`) copied by reference into the item's own database, one atomic transaction."""
    found = ts_writes.bucket_of(directory)
    url, folder = found
    ctx = ts_utils.get_ts_context(use_ocdbt=True)
    item = await ts.KvStore.open(kvstore_spec(url.child(folder.rstrip("/"))), context=ctx)
    keys = await item.list(ts.KvStore.KeyRange("ocdbt.process_", "ocdbt.process`"))
    names = sorted({k.decode("utf-8", "replace").split("/", 1)[0] for k in keys
                    if k.decode("utf-8", "replace").endswith("/manifest.ocdbt")})
    if not names:
        return
    mixed = sorted(n for n in os.listdir(directory) if n.startswith("ocdbt.process_"))
    if mixed:  # (values Orbax's own handlers wrote locally: their manifest would replace the bucket's)
        raise CheckpointError(f"{url.child(folder.rstrip('/'))}: holds both arrays TensorStore wrote to the bucket and "
                              f"values Orbax wrote locally ({mixed[0]}); save it to a local folder, then copy it up")
    children = [await ts.KvStore.open(ts_writes.to_bucket(ts_utils.build_kvstore_tspec(
        os.path.join(directory, n), use_ocdbt=True)), context=ctx) for n in names]
    parent = await ts.KvStore.open(ts_writes.to_bucket(ts_utils.build_kvstore_tspec(
        directory, use_ocdbt=True, ocdbt_write_options=ts_utils.OcdbtKvStoreWriteOptions(
            mode=ts_utils.OcdbtWriteMode.MERGE))), context=ctx)
    txn = ts.Transaction(atomic=True)
    await asyncio.gather(*(c.experimental_copy_range_to(parent.with_transaction(txn)) for c in children))
    await txn.commit_async()


def _filesystem_sync(targets: list) -> FilesystemSync | None:
    """One `FilesystemSync` for the raw chunk folders of an item (opened now, before any chunk is
    written), where they are all on one filesystem that allows it; else None: each chunk file is
    fsync'd as it is written, as before."""
    folders = [t.folder for t in targets if t is not None]
    if not folders:
        return None
    try:
        if len({os.stat(f).st_dev for f in folders}) != 1:
            return None
    except OSError:
        return None
    return FilesystemSync.open(os.path.dirname(folders[0]))  # (the item's folder: named by an error)


async def _create_arrays(specs: list, infos: list, fsync: bool = True) -> None:
    """Create each array of the item (its zarr metadata) in order, as Orbax does; without `fsync`,
    TensorStore skips its fsyncs of each `.zarray` and its folder (`file_io_sync`: 72 of a 36-array
    import): the item's one syncfs, after every array is created, makes them durable with its chunks."""
    for spec, info in zip(specs, infos, strict=True):
        context = info.ts_context if fsync else ts.Context(ts.Context.Spec({"file_io_sync": False}), parent=info.ts_context)
        await ts.open(ts.Spec(spec.json), create=True, open=True, context=context)


async def _nothing() -> None:
    return None


async def _shardings_written(values: list, infos: list, primary_host: int | None, opts: StreamOptions) -> None:
    """The item's `_sharding` record, written by Orbax's own writer (`_async_serialize_shardings`:
    one TensorStore transaction, committed and synced by TensorStore); a failure stops the tiles
    of the save as a tile's does (`_Budget.failed`)."""
    try:
        await jax_array_handlers._async_serialize_shardings(  # noqa: SLF001 - Orbax's own writer
            shardings=[v.sharding for v in values], infos=infos, primary_host=primary_host
        )
    except BaseException as e:
        opts.budget().failed.append(e)
        raise


_planner_lock = threading.Lock()
_planner_pool: ThreadPoolExecutor | None = None


def _planner() -> ThreadPoolExecutor:
    """The one thread that plans the leaves' tiles (`_planned_tiles`), in the order asked."""
    global _planner_pool
    with _planner_lock:
        if _planner_pool is None:
            _planner_pool = ThreadPoolExecutor(1, thread_name_prefix="hybridckpt-plan")
        return _planner_pool


def _planned_tiles(leaf: LazyLeaf, chunk: tuple[int, ...], opts: StreamOptions) -> list[Box]:
    """`stream.owned_tiles` of `leaf` (its tile size found by a dry read of its first tile, and
    a chunk header parsed on first use: tens of milliseconds of Python a leaf), on the planner
    thread. Planned in the event loop, the 36 leaves of a one-layer FSDP2 import with AdamW were
    planned one after the other before the first tile was read (every leaf's coroutine runs to
    its first await before any tile's): 1.4 s of a 6 s import on the main thread, no reader busy."""
    with timing.stage("plan"):
        return stream.owned_tiles(leaf, chunk, opts.tile_bytes, opts.inflight_bytes)


def _in_pool(loop: asyncio.AbstractEventLoop, fn, *args, executor: ThreadPoolExecutor | None = None) -> asyncio.Future:
    """`fn(*args)` in the reader pool (or `executor`), awaitable in `loop`; a result arriving
    after the loop closed (a failed save whose other reads were still running) is dropped quietly."""
    result = loop.create_future()

    def deliver(cf) -> None:
        if result.cancelled():
            return
        if cf.exception() is not None:
            result.set_exception(cf.exception())
        else:
            result.set_result(cf.result())

    def done(cf) -> None:
        if loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(deliver, cf)
        except RuntimeError:  # closed in between
            pass

    (executor or parallel.pool()).submit(fn, *args).add_done_callback(done)
    return result


async def _all(coros: list) -> None:
    """Await every coroutine, then raise the first error: no reader thread outlives the save's
    event loop (Orbax closes it as soon as the save returns)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


class _SmallWrites:
    """Small tiles share a non-atomic TensorStore transaction, committed once it holds `limit`
    bytes and at the end: each OCDBT commit rewrites the B-tree root (and chunks under 1 KiB
    are inlined in it), so batching keeps the files compact. A staged tile leaves the byte
    budget at once (no tile ever waits on a commit, so no deadlock); the staged bytes are
    bounded by `limit` per transaction instead (one filling, one committing)."""

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self.txn = ts.Transaction(atomic=False)
        self.staged = 0

    async def write(self, store: ts.TensorStore, index, buf: np.ndarray, n: int) -> None:
        await store.with_transaction(self.txn)[index].write(buf, can_reference_source_data_indefinitely=True)
        self.staged += n
        if self.staged >= self.limit:
            await self.commit()

    async def commit(self) -> None:
        txn, staged = self.txn, self.staged
        self.txn, self.staged = ts.Transaction(atomic=False), 0
        if staged:
            await txn.commit_async()

    def abort(self) -> None:
        self.txn.abort()


class _Registry(ocp.type_handlers.TypeHandlerRegistry):
    """Orbax's global type registry plus `LazyLeaf`; restores use the global one unchanged."""

    def __init__(self, lazy: LazyArrayHandler):
        self._lazy = lazy

    def add(self, ty, handler, func=None, override=False):  # pragma: no cover - not used
        raise NotImplementedError("hybridckpt's streaming registry is read-only")

    def get(self, ty):
        if isinstance(ty, type) and issubclass(ty, LazyLeaf):
            return self._lazy
        return ocp.type_handlers.get_type_handler(ty)

    def has(self, ty) -> bool:
        try:
            self.get(ty)
            return True
        except ValueError:
            return False


def _registry() -> _Registry:
    store = getattr(ocp.type_handlers.get_type_handler(jax.Array), "_array_metadata_store", None)
    return _Registry(LazyArrayHandler(array_metadata_store=store))


SPOOLED_APART = threading.Event()  # set while each process saves into a folder of its own (`writers.remote_shared`)


class _Validator(array_metadata_store.Validator):
    """Orbax's finalize check that every process recorded the same arrays (process 0 reads the
    `array_metadatas/process_<i>` records of all), skipped while `SPOOLED_APART`: each process's
    record is then in its own folder, which that process uploads; process 0 sees only its own."""

    def validate_all_array_metadatas(self, array_metadatas) -> None:
        if not SPOOLED_APART.is_set():
            super().validate_all_array_metadatas(array_metadatas)


class StreamingCheckpointHandler(ocp.StandardCheckpointHandler):
    """`StandardCheckpointHandler` that also saves `LazyLeaf` leaves (restores are unchanged,
    and its type string is the standard one, so `_CHECKPOINT_METADATA` is identical).

    A save whose lazy leaves are all raw (`compression` "none") is written without OCDBT, each
    chunk a file (`containers.orbax.chunk_files`); any other save (jax.Arrays from a training loop,
    compressed imports) in OCDBT, Orbax's default. Restores read either: Orbax records which
    in the item's `_METADATA` (`use_ocdbt`)."""

    def __init__(self) -> None:
        super().__init__()
        self._supported_types = (*self._supported_types, LazyLeaf)
        registry = _registry()
        self._by_ocdbt = {
            use: ocp.PyTreeCheckpointHandler(
                save_concurrent_gb=96, restore_concurrent_gb=96, use_ocdbt=use, type_handler_registry=registry,
                array_metadata_validator=_Validator(),
            )
            for use in (True, False)
        }
        self._impl = self._by_ocdbt[True]

    def finalize(self, directory) -> None:
        """Orbax's finalize; an OCDBT item written to a bucket (`io.remote.ts_writes`) merged there
        first (Orbax's own merge looks for the per-process databases in the local folder only,
        finds none and skips)."""
        if self._impl is self._by_ocdbt[True] and ts_writes.bucket_of(str(directory)) is not None:
            try:
                asyncio.run(_merge_in_bucket(str(directory)))
            except ValueError as e:
                raise ts_writes.write_error(str(directory), e) from None
        super().finalize(directory)

    async def async_save(self, directory, item=None, save_args=None, args=None):
        tree = args.item if args is not None else item
        self._impl = self._by_ocdbt[not _all_raw_lazy(tree)]  # also the one `finalize` uses
        return await super().async_save(directory, item=item, save_args=save_args, args=args)

    def close(self) -> None:
        for impl in self._by_ocdbt.values():
            impl.close()

    @classmethod
    def typestr(cls) -> str:
        return ocp.StandardCheckpointHandler.typestr()
