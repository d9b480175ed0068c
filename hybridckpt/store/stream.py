"""Streaming Orbax save: arrays written from lazy tensors tile by tile, never whole in memory.

A leaf of a tree given to `store.CheckpointStore.save` / `store.save_checkpoint` may be a `LazyLeaf` (a
`LazyTensor` plus its target sharding) instead of a jax.Array. Orbax treats the tree exactly
as a tree of jax.Arrays (the `_METADATA` tree, `_sharding`, `array_metadatas/`, the atomic
commit); only the data path differs (`store.stream_orbax`: the Orbax type handler):

- every distinct shard box is written once, by the process of the lowest-id device holding it;
  the boxes a process writes are joined where they sit side by side (`joined_boxes`: the strips
  of one source row that a mesh cutting the rows gives its devices are read as whole rows,
  once), and cut into tiles: boxes made of whole chunks of at most `tile_bytes` (`plan_tiles`; a stacked
  `[layers, ...]` leaf is chunked per layer, so its tiles are whole layers), split along the
  kernel's last axis where that reads whole rows of a transposed source, and grown up to 64 MiB
  where the source's reads are short (`box_tiles`, `leaf_tiling`);
- the reader pool (`hybridckpt.lazy.parallel`) fills a fresh buffer per tile (`read_tile`:
  `LazyTensor.read_into`: preads, casts, TP concatenation) and adds the tile's part of the leaf's
  checksum (`checksum.CHUNKS` on the chunk grid);
- raw chunks (the default codec) go straight to their files from the reader thread
  (`containers.orbax.chunk_files`: the item is saved without OCDBT, one file per chunk, fsync'd);
  compressed ones are written by TensorStore into the item's OCDBT database.

Codec: `StreamOptions.compression` (`containers.orbax.codec`; "none" by default: raw chunks, in plain files;
"zstd": in OCDBT, as Orbax writes by default).

Memory: tiles read but not yet written are bounded by `inflight_bytes` (`_Budget`; a tile larger
than the bound runs alone), plus at most two batches of small tiles (`SMALL_BATCH_BYTES`) staged
for a shared OCDBT commit, so peak host memory is a few tiles, whatever the checkpoint size. The
result is an ordinary Orbax checkpoint, the same files as Orbax's own save of the same jax.Arrays
with the same SaveArgs (tests/store/test_streaming.py compares them byte for byte and restores
onto other meshes).
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from hybridckpt import checksum
from hybridckpt.containers.orbax.codec import COMPRESSION
from hybridckpt.io import timing
from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.io.direct_io import aligned_empty
from hybridckpt.lazy import Box, LazyTensor, box_shape, element_copy, parallel
from hybridckpt.plan import box_owners

CHUNK_BYTES = 8 << 20  # zarr chunk target: small against any shard a resharding restore reads
TILE_BYTES = 8 << 20  # bytes per read/write unit (whole chunks; at least one chunk). 8 MiB against
# 16: 0.75x the import's peak memory (445 vs 600 MiB, 0.6 GB sources) and 0.93x the wall time of a
# bf16 Meta import (fp32 HF 1.03x, within noise): less of each tile's buffers is fresh pages
INFLIGHT_BYTES = 128 << 20  # a save's tile buffers at most: tiles read but not yet written, across every
# leaf, and a strip's copy a writer thread (`StreamOptions.budget`; `stream_orbax._write_tile`)
SMALL_TILE_BYTES = 1 << 20  # tiles under this size (norms, biases, small arrays) are batched:
SMALL_BATCH_BYTES = 16 << 20  # they share one OCDBT commit per this many bytes


@dataclass
class StreamStats:
    """What one streaming save did, per process: bytes written, tiles, and the most tile bytes
    held at once (read or being written), the bound the memory tests check."""

    bytes_written: int = 0
    tiles: int = 0
    peak_inflight_bytes: int = 0
    largest_tile_bytes: int = 0


@dataclass(eq=False)
class StreamOptions:
    """Knobs of one streaming save, shared by all its leaves (one byte budget for all)."""

    tile_bytes: int = TILE_BYTES
    inflight_bytes: int = INFLIGHT_BYTES
    chunk_bytes: int = CHUNK_BYTES
    compression: str = COMPRESSION  # "none", "zstd", "zstd:LEVEL" (`containers.orbax.codec`)
    direct_io: bool = True  # raw chunk files of whole 4 KiB blocks with O_DIRECT (`containers.orbax.chunk_files`)
    batched_sync: bool = True  # raw chunk files made durable by one syncfs per item, not an fsync each (`io.writeback.FilesystemSync`)
    on_leaf: Callable[[str, int], None] | None = None  # (leaf name, bytes) once written
    stats: StreamStats = field(default_factory=StreamStats)
    _budgets: dict = field(default_factory=dict, repr=False)

    def small_batch_bytes(self) -> int:
        """Bytes of small tiles per shared transaction (see `_SmallWrites`), at most a quarter
        of the budget."""
        return max(1, min(SMALL_BATCH_BYTES, self.inflight_bytes // 4))

    def small_tile_bytes(self) -> int:
        return min(SMALL_TILE_BYTES, self.small_batch_bytes())

    def budget(self) -> _Budget:
        """The byte budget (and item count) of the save running in this event loop."""
        loop = asyncio.get_running_loop()
        if id(loop) not in self._budgets:
            # the writers take the tiles the readers read, so the tiles fill their budget: it leaves room
            # in the pool for a strip's copy a writer (`chunk_files.write_tile`), at most half of it, and
            # the buffers stay within `inflight_bytes` (a 4.4 GiB import: 0.38-0.41 GiB of peak RSS;
            # 128 MiB for the tiles alone: 0.43-0.46 GiB, 4-7% faster; the pool with no room made 146
            # fresh buffers, not 47)
            spare = min(parallel.write_threads() * self.chunk_bytes, self.inflight_bytes // 2)
            self._budgets[id(loop)] = _Budget(self.inflight_bytes - spare, self.stats, spare)
        return self._budgets[id(loop)]


@dataclass(eq=False)
class LazyLeaf:
    """A leaf to save: `tensor` (global shape and dtype) placed by `sharding`.

    chunk_axes: axes every chunk has extent 1 on (0 for a stacked `[layers, ...]` leaf).
    After the save, `checksum` is this process's part of the tensor's `checksum.CHUNKS` checksum
    on the grid of its stored chunks, `checksum_chunk` (the sum over the chunks this process
    wrote), and `crcs` the CRC-32 of each of those chunks by grid position (what every later
    read of the store checks: `store.checked`).
    """

    tensor: LazyTensor
    sharding: jax.sharding.Sharding
    name: str = ""
    chunk_axes: tuple[int, ...] = ()
    options: StreamOptions | None = None
    checksum: int = 0
    checksum_chunk: tuple[int, ...] | None = None
    crcs: dict[int, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.tensor.dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def add_part(self, part: int) -> None:
        with self._lock:
            self.checksum = checksum.combine((self.checksum, part))

    def add_crcs(self, crcs: list[tuple[int, int]]) -> None:
        """Record chunks written: (grid position, CRC-32) each, and their checksum part."""
        part = checksum.combine(checksum.part_of(i, c) for i, c in crcs)
        with self._lock:
            self.crcs.update(crcs)
            self.checksum = checksum.combine((self.checksum, part))

    def crc_table(self) -> np.ndarray:
        """This process's CRC-32 per grid position (uint32; 0 where another process wrote the
        chunk): summed over processes, the table `trainer_state["chunk_crc32"]` records."""
        chunk = self.checksum_chunk or self.shape
        table = np.zeros(checksum.grid_size(self.shape, chunk), np.uint32)
        for i, c in self.crcs.items():
            table[i] = c
        return table


def opts_of(values) -> StreamOptions:
    """The options of the first leaf that has some (all leaves of one save share them), else
    fresh defaults for this batch of leaves."""
    return next((v.options for v in values if v.options is not None), None) or StreamOptions()


def save_args(tree: Any, chunk_bytes: int | None = None) -> Any:
    """Orbax SaveArgs per leaf: for a LazyLeaf, chunks of at most `chunk_bytes` (default its
    options' or CHUNK_BYTES) with extent 1 on its `chunk_axes`; None for other leaves."""

    def one(x):
        if not isinstance(x, LazyLeaf):
            return None
        size = chunk_bytes or (x.options.chunk_bytes if x.options else CHUNK_BYTES)
        return ocp.SaveArgs(chunk_byte_size=size, shard_axes=tuple(x.chunk_axes))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, LazyLeaf))


def has_lazy(tree: Any) -> bool:
    return any(isinstance(x, LazyLeaf) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LazyLeaf)))


# -- planning (pure) ------------------------------------------------------------------------------


def owned_boxes(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> list[Box]:
    """Distinct shard boxes this process writes: those whose lowest-id holding device is ours."""
    me = jax.process_index()
    return sorted(b for b, d in box_owners(tuple(shape), sharding).items() if d.process_index == me)


def joined_boxes(boxes: list[Box]) -> list[Box]:
    """`boxes` (disjoint) with every two that are equal on all axes but one and touch on it
    joined, until none are: the shard boxes one process writes, as the few boxes it reads.
    A mesh that cuts a tensor along the rows its source stored whole (fsdp on the `in` dim of
    torch's `[out, in]`) gives each device a strip of every row; the process's strips side by
    side are whole rows, read once (one run a row, or one run) and cut into the devices' chunks
    in memory, instead of each device's strip read apart (a run a row each, or the rows' whole
    span again per device). Sorted; pure; O(n log n) a pass over the axes (a one-host plan of
    hundreds of devices' boxes)."""
    out = sorted(set(boxes))
    changed = True
    while changed:  # one pass an axis: boxes alike elsewhere, touching on the axis, joined in order
        changed = False
        for k in range(len(out[0]) if out else 0):
            groups: dict[tuple, list] = {}
            for b in out:
                groups.setdefault(b[:k] + b[k + 1 :], []).append(b)
            nxt = []
            for same in groups.values():
                same.sort(key=lambda b: b[k])
                run = same[0]
                for b in same[1:]:
                    if b[k][0] == run[k][1]:
                        run = run[:k] + ((run[k][0], b[k][1]),) + run[k + 1 :]
                        changed = True
                    else:
                        nxt.append(run)
                        run = b
                nxt.append(run)
            out = nxt
    return sorted(out)


def owned_tiles(leaf: LazyLeaf, chunk: tuple[int, ...], tile_bytes: int,
                inflight_bytes: int = INFLIGHT_BYTES) -> list[Box]:
    """The tiles this process reads and writes of `leaf`: its shard boxes joined
    (`joined_boxes`), each cut by `box_tiles`. The plan (`jobs.plan_report`) and the save cut the
    same tiles."""
    return [t for box in joined_boxes(owned_boxes(leaf.shape, leaf.sharding))
            for t in box_tiles(leaf, box, chunk, tile_bytes, inflight_bytes)]


def first_joined_box(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
                     owner: Callable[[Any], int] | None = None) -> Box:
    """The joined box (`joined_boxes`) holding the lowest shard box, among the boxes of the
    process that writes it: the same on every process. `owner`: a device's process (None: jax's
    `process_index`; a plan of one host of a run this process is not part of passes the
    split it simulates, `jobs.plan_report.process_of`, so it joins what that host would)."""
    owner = owner or _process_index
    owners = box_owners(tuple(shape), sharding)
    first = min(owners)
    proc = owner(owners[first])
    mine = joined_boxes([b for b, d in owners.items() if owner(d) == proc])
    return next(j for j in mine if all(a <= x and y <= b for (a, b), (x, y) in zip(j, first, strict=True)))


def _process_index(device: Any) -> int:
    return device.process_index


def chunk_shape(leaf: LazyLeaf) -> tuple[int, ...]:
    """The chunk shape Orbax gives `leaf` in a raw (uncompressed, no OCDBT) save: its
    `choose_chunk_shape` over the shard shape with the leaf's `save_args` (OCDBT may lower the
    chunk bytes to its data file size, 2 GiB by default: the same chunks at `CHUNK_BYTES`)."""
    # build_array_write_spec's own chunk rule (pinned by tests/store/test_orbax_private.py)
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    arg = save_args(leaf)
    return tuple(ts_utils.subchunking.choose_chunk_shape(
        leaf.shape, tuple(leaf.sharding.shard_shape(leaf.shape)), leaf.dtype, arg.chunk_byte_size,
        shard_axes=tuple(arg.shard_axes),
    ))


def plan_tiles(box: Box, chunk: tuple[int, ...], itemsize: int, budget: int,
               order: tuple[int, ...] | None = None) -> Iterator[Box]:
    """Sub-boxes of `box` made of whole chunks (`box` starts on the chunk grid), each at most
    `budget` bytes where one chunk allows, split along the axes in `order` first (default: the
    leading axes first, so a tile of a row-major source is a few long runs; `split_orders`)."""
    nbytes = math.prod(box_shape(box)) * itemsize
    if nbytes <= budget:
        yield box
        return
    for ax in range(len(box)) if order is None else order:
        (a, b), c = box[ax], chunk[ax]
        if b - a > c:
            sub = list(box)
            sub[ax] = (a, a + c)
            per_chunk_row = math.prod(box_shape(tuple(sub))) * itemsize
            step = max(1, budget // max(1, per_chunk_row)) * c
            for s in range(a, b, step):
                sub[ax] = (s, min(b, s + step))
                yield from plan_tiles(tuple(sub), chunk, itemsize, budget, order)
            return
    yield box  # one chunk larger than the budget


def split_orders(ndim: int) -> list[tuple[int, ...]]:
    """The axis orders a leaf's tiles may be split in (`plan_tiles`), the preferred first: (2-D
    and up) the last two axes swapped, then the leading axes first. The first suits a
    transposed source: a torch `[out, in]` weight read into a JAX `[in, out]` kernel stores
    whole `in` rows, so tiles cut along `out` (the kernel's last axis) are runs of whole file
    rows (one read a strip, nothing skipped), and their chunks whole rows of the tile (written
    with no copy out of it), where tiles cut along `in` read a strip of every file row (the gaps
    between read too, or a pread a strip) and copy each chunk out of the tile. A row-major
    source is the other way round (`leaf_tiling` reads which)."""
    first = tuple(range(ndim))
    return [first] if ndim < 2 else [first[:-2] + (ndim - 1, ndim - 2), first]


SHORT_READ_BYTES = 64 << 10  # a tile whose reads average less than this may grow, or be split otherwise (`box_tiles`):
# a call costs ~4 us (`io.read_batches`), the page-cache copy of 64 KiB ~20-30 us
GROWN_TILE_BYTES = 64 << 20  # the most a tile grows to; at most half the in-flight budget


@dataclass(frozen=True)
class Tiling:
    """How a leaf's boxes are cut into tiles (`plan_tiles`): at most `budget` bytes each where a
    chunk allows, split along the axes in `order` first."""

    budget: int
    order: tuple[int, ...]


def box_tiles(leaf: LazyLeaf, box: Box, chunk: tuple[int, ...], tile_bytes: int,
              inflight_bytes: int = INFLIGHT_BYTES, owner: Callable[[Any], int] | None = None) -> list[Box]:
    """The tiles of `box` (`plan_tiles`) as the leaf's tiling cuts them (`leaf_tiling`; `owner`:
    see `first_joined_box`): the plan (`jobs.plan_report`) and the import cut the same tiles."""
    tiling = leaf_tiling(leaf, chunk, tile_bytes, inflight_bytes, owner)
    return list(plan_tiles(box, chunk, leaf.dtype.itemsize, tiling.budget, tiling.order))


_TILING_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # leaf -> {(chunk, sizes, owner): Tiling}


def leaf_tiling(leaf: LazyLeaf, chunk: tuple[int, ...], tile_bytes: int,
                inflight_bytes: int = INFLIGHT_BYTES, owner: Callable[[Any], int] | None = None) -> Tiling:
    """The tiling of `leaf`: `tile_bytes` split along the leading axes, unless the source's reads
    are short. A target mesh cutting a tensor across the rows its source stored whole (fsdp on
    the `in` dim of a torch `[out, in]` weight) reads a strip of every source row, and a tile
    of fewer chunks along the cut axis cuts each strip again (8 MiB tiles of a 405B fsdp=64
    import: strips of 128 B; the device's whole box: 1 KiB). The first tile of the leaf's first
    box (the lowest, whichever process holds it: every process decides alike) is read dry
    (`planning`: counted, not read) at `tile_bytes` (of the first joined box,
    `first_joined_box`), then at twice that while its reads average under `SHORT_READ_BYTES`
    and each doubling makes them at least 1.5x longer, up to `GROWN_TILE_BYTES` (at most half
    `inflight_bytes`), for each axis order of `split_orders` in turn until one reads long runs
    (`_tiling`: a transposed source's tiles cut along the kernel's last axis read whole file
    rows). Once per leaf (its boxes are alike). `owner`: a device's process
    (`first_joined_box`; None: jax's)."""
    key = (tuple(chunk), tile_bytes, inflight_bytes, owner)
    known = _TILING_OF.setdefault(leaf, {})
    if key not in known:
        known[key] = _tiling(leaf, first_joined_box(leaf.shape, leaf.sharding, owner), chunk, tile_bytes,
                             min(GROWN_TILE_BYTES, inflight_bytes // 2))
    return known[key]


def _tiling(leaf: LazyLeaf, box: Box, chunk: tuple[int, ...], tile_bytes: int, limit: int) -> Tiling:
    """`leaf_tiling` on its first box: the first order of `split_orders` whose (grown) tiles
    read long runs; where none does, the leading axes first unless another order's runs are
    1.5x longer (the tiles the import cut before orders were tried)."""
    short: list[tuple[float, Tiling]] = []
    for order in split_orders(len(chunk)):
        budget, mean = _grown_tile_bytes(leaf, box, chunk, tile_bytes, limit, order)
        if mean is None:  # the box is one tile: nothing to choose
            return Tiling(tile_bytes, tuple(range(len(chunk))))
        if mean >= SHORT_READ_BYTES:
            return Tiling(budget, order)
        short.append((mean, Tiling(budget, order)))
    mean, tiling = short[-1]  # the leading axes first
    return next((t for m, t in short if m >= 1.5 * mean), tiling)


def _grown_tile_bytes(leaf: LazyLeaf, box: Box, chunk: tuple[int, ...], budget: int, limit: int,
                      order: tuple[int, ...]) -> tuple[int, float | None]:
    """(the tile size `leaf_tiling` grows `box`'s first tile to along `order`, the bytes per read
    run there); (budget, None) where the box is one tile at `budget`."""
    item = leaf.dtype.itemsize
    tiles = list(plan_tiles(box, chunk, item, budget, order))
    if len(tiles) < 2:
        return budget, None
    mean = _mean_read_bytes(leaf, tiles[0])
    while mean < SHORT_READ_BYTES and budget < limit:
        wider = list(plan_tiles(box, chunk, item, min(limit, 2 * budget), order))
        if len(wider) == len(tiles):
            break  # the box's chunks allow no larger first tile
        longer = _mean_read_bytes(leaf, wider[0])
        if longer < 1.5 * mean:
            break
        budget, tiles, mean = min(limit, 2 * budget), wider, longer
    return budget, mean


def _mean_read_bytes(leaf: LazyLeaf, box: Box) -> float:
    """Bytes per file run of `leaf`'s read of `box` (runs, not calls: runs close together are
    one call, `io.byte_source`, but still a strip each), planned (no data byte read; a chunk's
    header the reader parses on first use is read, as the import would); inf for a tensor that
    reads no file."""
    from hybridckpt.io.byte_source import count_reads, planning
    from hybridckpt.io.read_tally import runs_of, tally

    out = np.empty(box_shape(box), leaf.dtype)  # never written: planning leaves the copies out
    # values computed from unread buffers (a dequantization) are garbage: no warning about them
    with count_reads(this_thread=True) as c, planning(), np.errstate(all="ignore"):
        leaf.tensor.read_into(box, out)
    nbytes, _, _, _ = tally(c)
    runs = runs_of(c)
    return nbytes / runs if runs else math.inf


# -- the byte budget ------------------------------------------------------------------------------


class _Budget:
    """Bytes of tiles held (read or being written); a tile waits until it fits (or runs alone)."""

    def __init__(self, limit: int, stats: StreamStats, spare_bytes: int = 0):
        self.limit, self.used, self.stats = max(1, int(limit)), 0, stats
        self.active = 0
        self.failed: list[BaseException] = []  # errors of this save: the other tiles stop reading
        self.cond = asyncio.Condition()
        self.buffers = AlignedPool(self.limit + spare_bytes)  # a raw save's tile buffers, reused (`io.aligned_pool`)
        # a raw save's tiles held at once (being read, waiting for a writer or written): one a
        # reader or writer thread, so the tiles read ahead stay few (`stream_orbax._write_tile`)
        self.tiles = asyncio.Semaphore(parallel.io_threads() + parallel.write_threads())

    async def acquire(self, n: int) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.used)

    async def release(self, n: int) -> None:
        async with self.cond:
            self.used -= n
            self.cond.notify_all()

    async def enter(self) -> None:
        """One more item (a `serialize` call) of this save is writing. The items of one save
        all enter in the same event-loop turn (Orbax gathers them), before any can fail."""
        async with self.cond:
            if self.active == 0:
                self.failed = []  # a new save on this loop
            self.active += 1

    async def leave(self, wait: bool = False) -> None:
        """This item is done; with `wait`, return once every other item is done too."""
        async with self.cond:
            self.active -= 1
            if self.active == 0:
                self.buffers.clear()  # the save is over: no tile buffer kept past it
                element_copy.release_stages()  # nor a reader's staging rows (`lazy.element_copy`)
            self.cond.notify_all()
            if wait:
                await self.cond.wait_for(lambda: self.active == 0)


# -- the Orbax type handler -----------------------------------------------------------------------


def read_tile(leaf: LazyLeaf, box: Box, chunk: tuple[int, ...], buf: np.ndarray | None = None,
              with_crcs: bool = True) -> np.ndarray:
    """One tile (whole chunks of shape `chunk`) into `buf` (default: a fresh aligned buffer),
    adding its checksum part unless `with_crcs` is False (a raw import checksums each chunk as
    it writes it: `containers.orbax.chunk_files.write_tile_crcs`). Runs in a reader thread."""
    with timing.stage("read"):  # (the bytes: those the source's files gave, `io.byte_source`)
        if buf is None:
            buf = aligned_empty(box_shape(box), leaf.dtype)  # (O_DIRECT writes it from here)
        leaf.tensor.read_into(box, buf)
    if with_crcs:
        with timing.stage("checksum", buf.nbytes):
            crcs = checksum.tile_crcs(leaf.shape, chunk, box, buf)
        leaf.add_crcs(crcs)
    return buf
