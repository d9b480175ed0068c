"""Every read of our store checked against the CRC-32s recorded at import.

An import records, per array, the CRC-32 of each chunk of its stored grid (`checksum.tile_crcs`,
`trainer_state["chunk_crc32"]`: name -> base64 of uint32s in grid C order, the grid in
`"checksum_chunks"`). `CheckedArray` wraps the lazy reader of an array (`containers.orbax.reader`) so that
no byte of it reaches a caller unchecked:

- `read_into(box, out)`: each grid chunk the box covers whole is read into `out` (where `out`
  is strided or cast: into a buffer the restore's scratch pool lends, else a fresh one, then
  copied) and its CRC compared; a chunk the box cuts is read whole
  once, by one thread (`_reading`; another box's thread that needs it meanwhile reads its other
  chunks first, trying the put-off piece again after each, then waits), checked, its piece cut
  out and its rest kept (`store.held_chunks`) for the boxes that need the rest, which cut their
  pieces from memory; in a restore the chunk is read into a buffer the scratch pool lends, which
  the thread that cuts its last piece gives back. So a restore onto a mesh that cuts
  chunks reads each chunk it touches once (`tests/store/test_restore_reads.py` counts it); only
  past the budget of kept bytes is a later piece read again from the file, that piece alone.
  In a restore (`store.read_item.read_items` sets `direct`) a piece that is one run of a raw chunk's bytes (cut on
  its first axis) is read by one pread into a buffer the restore's scratch pool lends (reused, no
  fresh chunk buffer), its CRC-32 taken there by one call, and copied into its shard's rows; the
  chunk is compared once its pieces tile it (`checksum.crc32_of_pieces`), else (this process
  places only some) read whole and compared by `release` before the array is returned.
  A dry read (`io.byte_source.planning`: an import sizing its tiles) is counted as the real one
  would be and leaves nothing behind: no buffer kept, no chunk marked checked.
- `file_runs(box, limit)`: an export that copies stored bytes file to file gets runs that carry
  a `RunCheck` (`store.checked_runs`) per chunk; the copier feeds it the bytes as they pass (into its write buffer, or
  read back where the kernel copied them) and the CRC is compared when a chunk's last byte has
  passed. Only boxes of whole chunks are offered as runs.

A mismatch is one `CheckpointError` naming the item, the array, the chunk's grid position and box,
and the chunk file where there is one: a flipped byte, a truncated, missing or swapped chunk file
all end there. zlib-ng computes the CRC at tens of GB/s a core, and it runs over bytes already in
memory; `benchmarks/orbax_speed.py` measures the cost (docs/benchmarks.md). `checked=False` (CLI
`--no-verify-reads`) reads unchecked.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Mapping

import numpy as np

from hybridckpt import checksum
from hybridckpt.errors import CheckpointError, short_repr
from hybridckpt.io import timing
from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.io.byte_source import planned
from hybridckpt.lazy import Box, FileRun, LazyTensor, box_shape, copy_into, one_run
from hybridckpt.lazy.stored import SCATTER_ROW_BYTES, row_bytes, row_views
from hybridckpt.store.checked_runs import RunCheck, assign
from hybridckpt.store.held_chunks import (
    HELD_BYTES,  # (passed at each `keep`: a test lowers it here)
)
from hybridckpt.store.held_chunks import HeldChunks as _HeldChunks

CRC_TABLES = "chunk_crc32"  # trainer_state keys (written by `jobs.import_`)
ARRAY_SPECS = "array_specs"
IMPORT_RECORDS = ("checksums", "checksum_chunks", "checksum_algorithm", ARRAY_SPECS)  # written beside CRC_TABLES


def has_crc_tables(state: Mapping, where: str) -> bool:
    """Whether a step's reads are checked against CRC tables (`trainer_state[CRC_TABLES]`, an
    object). A step with none is read as saved only when it holds none of the records an import
    writes beside them (`IMPORT_RECORDS`: a training loop's save); tables that are not an object,
    or that were removed while the other records stayed, are a CheckpointError (`where`: the step):
    deleting them must not turn the checks off."""
    tables = state.get(CRC_TABLES)
    if isinstance(tables, Mapping):
        return True
    present = [k for k in IMPORT_RECORDS if k in state]
    if tables is None and not present:
        return False
    found = f"is a {type(tables).__name__}" if tables is not None else f"is missing, though {', '.join(present)} are present"
    raise CheckpointError(
        f"{where}: trainer_state[{CRC_TABLES!r}] (the CRC-32 of every stored chunk) {found}: the store's records "
        f"were changed; its reads cannot be checked (verify_reads=False reads it unchecked)",
        cli=f"{where}: trainer_state[{CRC_TABLES!r}] (the CRC-32 of every stored chunk) {found}: the store's records "
        f"were changed; its reads cannot be checked (--no-verify-reads reads it unchecked)",
    )


SCRATCH_PIECE_BYTES = 8 << 20  # `direct` pieces up to this are read into a lent buffer, then copied


class CheckedArray(LazyTensor):
    """`inner` (an array of our store) read only through chunks checked against `crcs` (uint32
    per position of the grid of `chunk`); `name` and `where` (the item folder) name it in errors."""

    def __init__(self, inner: LazyTensor, chunk: tuple[int, ...], crcs: np.ndarray, name: str, where: str):
        self.inner, self.chunk, self.crcs = inner, tuple(chunk), crcs
        self.name, self.where = name, where
        self.shape, self.dtype = tuple(inner.shape), np.dtype(inner.dtype)
        self.grid = tuple(-(-n // c) if n else 0 for n, c in zip(self.shape, self.chunk, strict=True))  # chunks a dim
        self._checked: set[int] = set()
        self._held = _HeldChunks()
        self._lock = threading.Lock()
        self._reading: dict[int, threading.Event] = {}  # chunks being read whole now, by one thread
        self._planned: set[int] = set()  # chunks a dry read (`io.byte_source.planning`) counted whole
        self.direct = False  # pieces read straight into their places, checked whole by `release`
        self._landed: dict[int, dict[int, tuple[int, int]]] = {}  # position -> start byte -> (bytes, CRC)
        self.scratch: AlignedPool | None = None  # buffers `direct` pieces are read into (`read_items`)
        self._raw: list | None = None  # [`inner`'s raw chunk files or None], once asked (`raw_grid`)

    # -- the grid --------------------------------------------------------------------------------
    def chunk_boxes(self, box: Box):
        """(position, clipped chunk box) of every grid chunk `box` overlaps, C order."""
        ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, self.chunk, strict=True)]
        for idx in itertools.product(*ranges):
            pos = 0
            for i, g in zip(idx, self.grid, strict=True):
                pos = pos * g + i
            cbox = tuple((i * c, min(n, (i + 1) * c)) for i, c, n in zip(idx, self.chunk, self.shape, strict=True))
            yield pos, cbox

    def compare(self, pos: int, crc: int) -> None:
        """Raise unless chunk `pos` has the CRC-32 recorded at import."""
        if planned():  # a read plan's buffers hold no file bytes: nothing checked, nothing marked
            return
        want = int(self.crcs[pos])
        if crc != want:
            raise CheckpointError(
                f"{self.where}: array {self.name}: chunk {self._position(pos)} ({self._describe(pos)}"
                f"{self._file(pos)}) has CRC-32 {crc:08x}, {want:08x} was recorded at import: the stored "
                f"bytes changed (damaged, truncated, replaced or missing chunk)"
            )
        self._checked.add(pos)

    def _position(self, pos: int) -> str:
        idx = []
        for g in reversed(self.grid):
            idx.append(pos % g if g else 0)
            pos = pos // g if g else 0
        return ".".join(str(i) for i in reversed(idx)) or "0"

    def _file(self, pos: int) -> str:
        """", file <path>" of the chunk in a raw item (a folder per array, a file per chunk)."""
        import os

        item_dir, array = getattr(self.inner, "item_dir", None), getattr(self.inner, "name", None)
        if not item_dir or not array:
            return ""
        path = os.path.join(item_dir, array, self._position(pos))
        return f", file {path}" if os.path.isfile(path) else ""

    def _describe(self, pos: int) -> str:
        idx = [int(i) for i in self._position(pos).split(".")] if self.shape else []
        box = [(i * c, min(n, (i + 1) * c)) for i, c, n in zip(idx, self.chunk, self.shape, strict=True)]
        return "elements " + " x ".join(f"[{a}:{b}]" for a, b in box) if box else "the scalar"

    # -- reads -----------------------------------------------------------------------------------
    def read_into(self, box: Box, out: np.ndarray) -> None:
        if out.size == 0:
            return
        later = []  # pieces of chunks another thread is reading whole now: taken after the rest
        for pos, cbox in self.chunk_boxes(box):
            sub = tuple((max(a, ca), min(b, cb)) for (a, b), (ca, cb) in zip(box, cbox, strict=True))
            dst = out[tuple(slice(s - a, e - a) for (s, e), (a, _) in zip(sub, box, strict=True)) or ...]
            if sub == cbox:  # the whole chunk: read once, checked on the way
                if dst.flags.c_contiguous and dst.dtype == self.dtype:
                    self.inner.read_into(cbox, dst)
                    self.compare(pos, _crc(dst))
                else:  # (strided or cast: read whole into a lent buffer in a restore, then copied)
                    tmp, give = self._read_chunk(cbox)
                    try:
                        self.compare(pos, _crc(tmp))
                        with timing.stage("cut"):
                            copy_into(dst, tmp)
                    finally:
                        if give is not None:
                            give()
            elif not self._piece(pos, cbox, sub, dst, wait=False):
                later.append((pos, cbox, sub, dst))
            # (a piece put off is cut as soon as its chunk is kept: the chunk's buffer back sooner)
            later = [x for x in later if not self._piece(*x, wait=False)]
        for pos, cbox, sub, dst in later:
            self._piece(pos, cbox, sub, dst, wait=True)

    def _piece(self, pos: int, cbox: Box, sub: Box, dst: np.ndarray, *, wait: bool) -> bool:
        """Read `sub`, a piece of chunk `pos` (box `cbox`), into `dst`; False (nothing done)
        when another thread is reading that chunk whole now and `wait` is False.

        A chunk is read from its file once: the first piece of it reads it whole (one thread
        at a time, `_reading`), checks it and keeps the rest (`_HeldChunks`); the other pieces
        are cut from what is kept, or wait for the read under way. Only where the kept bytes
        were past their budget is a later piece read again, that piece alone (the chunk was
        checked)."""
        if planned():  # a dry read: counted as the real one reads, no buffer kept, nothing marked
            with self._lock:
                first = pos not in self._planned
                self._planned.add(pos)
            if first:
                self.inner.read_box(cbox)
            return True
        if self.direct and self._direct_piece(pos, cbox, sub, dst):
            return True
        piece = tuple(slice(s - a, e - a) for (s, e), (a, _) in zip(sub, cbox, strict=True)) or ...
        elements = math.prod(box_shape(sub))
        while True:
            with self._lock:
                held = self._held.take(pos, elements)
                reading = None if held is not None else self._reading.get(pos)
                mine = None
                if held is None and reading is None and pos not in self._checked:
                    self._reading[pos] = mine = threading.Event()
            if held is not None:  # read whole for an earlier piece: the rest comes from memory
                try:
                    with timing.stage("cut"):
                        copy_into(dst, held[0][piece])
                finally:  # (after the chunk's last piece and last cut: its buffer back to the pool)
                    held[1]()
                return True
            if reading is not None:  # another thread reads it whole now
                if not wait:
                    return False
                reading.wait()
                continue
            if mine is None:  # checked, but not kept (over the budget): this piece alone
                self.inner.read_into(sub, dst)
                return True
            give, kept = None, False
            try:  # a piece of a chunk not checked yet: the chunk whole, once, its rest kept
                tmp, give = self._read_chunk(cbox)
                self.compare(pos, _crc(tmp))
                with timing.stage("cut"):
                    copy_into(dst, tmp[piece])
                kept = self._held.keep(pos, tmp, tmp.size - elements, give, HELD_BYTES)
            finally:
                if give is not None and not kept:
                    give()
                with self._lock:
                    del self._reading[pos]
                mine.set()
            return True

    def _read_chunk(self, cbox: Box):
        """(chunk `cbox` read whole, the callable that gives its buffer back or None): into a
        buffer `scratch` lends (a restore: its pages mapped already, reused chunk after chunk),
        else into a fresh one."""
        if self.scratch is None:
            return self.inner.read_box(cbox), None
        tmp, give = self.scratch.borrow(box_shape(cbox), self.dtype)
        try:
            self.inner.read_into(cbox, tmp)
        except BaseException:
            give()
            raise
        return tmp, give

    def _direct_piece(self, pos: int, cbox: Box, sub: Box, dst: np.ndarray) -> bool:
        """With `direct` on: read `sub`, a piece of chunk `pos` that is one run of the chunk's
        C-order bytes, and take its CRC-32; the chunk is compared once its pieces tile it
        (`checksum.crc32_combine`). False (nothing done) for any other piece.

        The run is read by one pread (O_DIRECT when cold) into a buffer lent by `scratch` (its
        pages mapped already: no fresh chunk buffer), checked by one CRC-32 call, and copied into
        the rows of `dst` by one numpy copy. Read straight into the rows instead (`preadv`), its
        CRC-32 taken row by row, is a Python call per row (a q/k/v/gate/up half is 256 rows of
        1-6 KiB: 192k calls and twice as many views in a 1.1 GB restore, 0.4-0.5 CPU-s, more
        than the copy costs); that is left for pieces past `SCRATCH_PIECE_BYTES`, or C-contiguous
        ones (one row: read in place). A lent buffer is filled from the chunk's file at the run's
        start (`_chunk_file`, `lazy.one_run`: no second walk of the grid and no numpy run table a
        piece, ~20 us of a piece's ~65 us of Python on the 2-core VM); a padded edge chunk through
        `inner`."""
        k, row = row_bytes(dst)
        if not checksum.has_crc32_combine() or dst.dtype != self.dtype or pos in self._checked or k < 0 \
                or row < SCATTER_ROW_BYTES or self.raw_grid() is None:
            return False
        shape = box_shape(cbox)
        start = one_run(shape, tuple((s - a, e - a) for (s, e), (a, _) in zip(sub, cbox, strict=True)))
        if start is None:
            return False
        item = self.dtype.itemsize
        if self.scratch is None or k == 0 or dst.nbytes > SCRATCH_PIECE_BYTES:
            self.inner.read_into(sub, dst)
            with timing.stage("checksum", dst.nbytes):
                crc = 0
                for row in row_views(dst):
                    crc = checksum.crc32_update(row, crc)
        else:
            tmp, give = self.scratch.borrow(dst.shape, dst.dtype)
            try:
                where = self._chunk_file(pos, shape)
                if where is None:
                    self.inner.read_into(sub, tmp)
                else:  # (the run's bytes straight from its chunk file: what `inner` would find)
                    where[0].read_into(where[1] + start * item, memoryview(tmp.reshape(-1).view(np.uint8)))
                crc = _crc(tmp)
                with timing.stage("cut"):
                    copy_into(dst, tmp)
            finally:
                give()
        with self._lock:
            landed = self._landed.setdefault(pos, {})
            landed[start * item] = (dst.size * item, crc)
            whole = checksum.crc32_of_pieces(landed, math.prod(shape) * item)
            if whole is not None:
                del self._landed[pos]
        if whole is not None:
            self.compare(pos, whole)
        return True

    def raw_grid(self):
        """`inner` as its raw chunk files (`containers.orbax.reader.raw_chunks`), or None (an
        array TensorStore decodes: a piece read there would decode its chunk again); asked once."""
        if self._raw is None:
            raw = getattr(self.inner, "raw", None)
            self._raw = [None if raw is None else raw()]
        return self._raw[0]

    def _chunk_file(self, pos: int, shape: tuple[int, ...]):
        """(file, byte offset) of stored chunk `pos` (shape `shape`) where the chunk files lie on
        this array's CRC grid; else None (read through `inner`, which finds the chunks a box meets)."""
        raw = self.raw_grid()
        return raw.chunk_file(pos, shape) if getattr(raw, "chunk", None) == self.chunk else None

    def release(self) -> None:
        """Give back the chunk bytes kept for pieces not read (another process's devices hold
        them), and check the chunks of which `direct` pieces were read but not all: each read
        whole from the file, its CRC-32 compared, and each landed piece's CRC-32 compared with its
        bytes there. Call when every box of this process has been read."""
        self._held.clear()
        with self._lock:
            pending, self._landed = self._landed, {}
        for pos, landed in pending.items():
            cbox = self._cbox(pos)
            data = self.inner.read_box(cbox)
            self.compare(pos, _crc(data))
            raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            for start, (n, crc) in landed.items():
                if checksum.crc32_update(raw[start: start + n], 0) != crc:
                    raise CheckpointError(
                        f"{self.where}: array {self.name}: chunk {self._position(pos)} ({self._describe(pos)}"
                        f"{self._file(pos)}): bytes [{start}, {start + n}) read earlier differ from the chunk "
                        f"now stored (the file changed while it was read)")

    def _cbox(self, pos: int) -> Box:
        idx = [int(i) for i in self._position(pos).split(".")] if self.shape else []
        return tuple((i * c, min(n, (i + 1) * c)) for i, c, n in zip(idx, self.chunk, self.shape, strict=True))

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        """The inner runs of a box of whole chunks, each carrying its chunk's `RunCheck`; None
        for a box that cuts a chunk (it is then read and checked by `read_into`)."""
        chunks = list(self.chunk_boxes(box))
        covered = sum(int(np.prod(box_shape(c))) for _, c in chunks)
        if covered != int(np.prod(box_shape(box))):
            return None
        inner = self.inner.file_runs(box, limit)
        if inner is None:
            return None
        # the runs of `box` in C order; each chunk's bytes form runs in its own C order, which
        # `checked_runs.assign` walks by following the box's C order chunk boundary by chunk boundary
        return assign(self, box, chunks, inner)

    def run_check(self, pos: int, nbytes: int) -> RunCheck:
        """The check of chunk `pos` (`nbytes` bytes) fed run by run (`file_runs`)."""
        return RunCheck(self, pos, nbytes)


def _crc(data: np.ndarray) -> int:
    """`checksum.crc32_of(data)`, timed as the stage "checksum" of a profiled job (`io.timing`)."""
    with timing.stage("checksum", data.nbytes):
        return checksum.crc32_of(data)


def checked_arrays(arrays: Mapping[str, LazyTensor], state: Mapping, prefix: str, where: str) -> dict[str, LazyTensor]:
    """`arrays` (leaf key -> lazy array of one item) wrapped in `CheckedArray` where
    `trainer_state` records their CRC tables under `prefix + key`; an import that recorded
    tables for an item but not for one of its arrays is an error, not an unchecked read."""
    if not has_crc_tables(state, where):
        return dict(arrays)
    tables, grids = state.get(CRC_TABLES), state.get("checksum_chunks") or {}
    specs = state.get(ARRAY_SPECS) or {}
    if not isinstance(grids, Mapping) or not isinstance(specs, Mapping):
        raise CheckpointError(f"{where}: trainer_state 'checksum_chunks' and {ARRAY_SPECS!r} must be objects")
    out = {}
    for key, t in arrays.items():
        name = prefix + key
        if name not in tables:
            raise CheckpointError(f"{where}: array {key} has no CRC-32s recorded beside the others (trainer_state)")
        spec = specs.get(name)
        if isinstance(spec, Mapping) and not isinstance(spec.get("shape", []), list):
            raise CheckpointError(
                f"{where}: trainer_state {ARRAY_SPECS!r} of array {key}: 'shape' expected a list of sizes, "
                f"found {short_repr(spec.get('shape'), 60)} ({type(spec.get('shape')).__name__})"
            )
        if isinstance(spec, Mapping) and (list(t.shape) != spec.get("shape", []) or np.dtype(t.dtype).name != spec.get("dtype")):
            raise CheckpointError(
                f"{where}: array {key} is stored as {np.dtype(t.dtype).name} {list(t.shape)} but its import wrote "
                f"{spec.get('dtype')} {spec.get('shape')}: its metadata (.zarray) was changed"
            )
        try:
            grid = tuple(int(c) for c in grids.get(name, t.shape))
        except (TypeError, ValueError, OverflowError):
            grid = ()
        if any(c <= 0 for c in grid):
            grid = ()
        size = checksum.grid_size(tuple(t.shape), grid) if len(grid) == len(t.shape) else -1
        crcs = None if size < 0 else checksum.decode_crcs(tables[name], size)
        if crcs is None:
            raise CheckpointError(f"{where}: array {key}: its recorded CRC-32 table does not fit its chunk grid {list(grid)}")
        out[key] = CheckedArray(t, grid, crcs, key, where)
    return out


def recorded_name(item: str, key: str, state: Mapping) -> str:
    """The name an import recorded an array's CRCs under: `params.<key>` for params; for the
    optimizer item `<slot state>.<path>` (`0.mu.x` -> `mu.x`) and `count`."""
    if item == "params":
        return f"params.{key}"
    from hybridckpt import optim

    opt = optim.get(state.get("optimizer") or optim.DEFAULT)
    for slot in opt.slots:
        prefix = opt.orbax_prefix(slot.name)
        if key.startswith(prefix):
            return f"{slot.state_name}.{key[len(prefix):]}"
    return "count" if key == opt.orbax_step else key
