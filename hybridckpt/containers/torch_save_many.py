"""`torch.save` of a nested value holding MANY tensors (an optimizer's `state_dict()`), written
without torch and streamed: each tensor's bytes go from the source to the file in bounded blocks.

The archive is what `torch.save(value, "<name>.pt")` writes (pytorch/pytorch:
torch/serialization.py `_save`, caffe2/serialize/inline_container.cc `PyTorchStreamWriter`,
miniz `mz_zip_writer_add_mem_ex_v2`), the single-tensor layout of `torch_save_write` generalised:

- records under the folder `<name>/` (torch names it after the file: `optimizer.pt` ->
  `optimizer/`): `data.pkl` (protocol 2), `.format_version`, `.storage_alignment`, `byteorder`,
  then one `data/<key>` per storage in the order of the keys (`"0"`, `"1"`, ..., `"10"`: the
  order torch 2.13 met them in), then `version` and `.data/serialization_id`;
- storage keys are `"0"`, `"1"`, ... in the order the pickle first meets each tensor (torch's
  `persistent_id`); each tensor here has its own storage (offset 0, C strides);
- records and offsets past 4 GiB take zip64 fields as miniz writes them: the local header's
  extra field holds a zip64 block (id 1: the uncompressed and compressed sizes when the record
  is that large, the local header's offset when it lies that far) before the 64-byte alignment
  padding, the data descriptor after such a record has 8-byte sizes (24 bytes), the central
  directory entry holds `0xFFFFFFFF` in each field moved to the block, the end record clamps
  its counts (`0xFFFF`) and offsets; the zip64 end record and locator are always written.

`torch.save(torch.load(f))` of an archive written here gives the same bytes (tested). Memory:
the pickle (about a hundred bytes a tensor) and one block of `WRITE_BLOCK_BYTES` at a time.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.pickle import emit
from hybridckpt.containers.safetensors_file import WRITE_BLOCK_BYTES
from hybridckpt.containers.torch_save_write import (
    _FIXED,
    _SID,
    _VERSION,
    ALIGN,
    STORAGE_CLASSES,
    _combine,
    _std_hash,
)
from hybridckpt.errors import FormatError
from hybridckpt.lazy import LazyTensor

U32 = 0xFFFFFFFF
U16 = 0xFFFF
ZIP64_AT = U32  # bytes: a record this large, or a header this far, takes zip64 fields (miniz's >=)

_REBUILD = emit.Global("torch._utils", "_rebuild_tensor_v2")
_ORDERED = emit.Global("collections", "OrderedDict")
_STORAGE_GLOBALS = {name: emit.Global("torch", cls) for name, cls in STORAGE_CLASSES.items()}
_STORAGE, _CPU = "storage", "cpu"  # one object each: memoized once in the pickle, as torch's


@dataclass(frozen=True)
class _Stored:
    key: str
    tensor: LazyTensor


class Tensors:
    """The tensors of one archive: `ref(t)` gives what to put in the value where tensor `t` goes
    (torch's `_rebuild_tensor_v2` of a new storage), its key the next number. Call `ref` in the
    order the pickle meets the tensors (dict insertion order, depth first) so the keys are
    torch's."""

    def __init__(self):
        self.stored: list[_Stored] = []

    def ref(self, t: LazyTensor) -> emit.Reduce:
        dtype = np.dtype(t.dtype)
        storage = _STORAGE_GLOBALS.get(dtype.name)
        if storage is None:
            raise FormatError(f"dtype {dtype} has no torch storage class to write")
        shape = tuple(int(n) for n in t.shape)
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        strides = tuple(int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(len(shape)))
        key = str(len(self.stored))
        self.stored.append(_Stored(key, t))
        pid = emit.PersistentId((_STORAGE, storage, key, _CPU, numel))
        return emit.Reduce(_REBUILD, (pid, 0, shape, strides, False, emit.Reduce(_ORDERED, ())))


# libstdc++'s unordered_set growth (`_Prime_rehash_policy`, max load 1): (size reached, buckets
# after); measured with g++ 12 inserting into a default-constructed std::unordered_set<string>
_REHASH = ((1, 13), (14, 29), (30, 59), (60, 127), (128, 257), (258, 541), (542, 1109), (1110, 2357),
           (2358, 5087), (5088, 10273), (10274, 20753), (20754, 42043), (42044, 85229), (85230, 172933),
           (172934, 351061), (351062, 712697), (712698, 1447153), (1447154, 2938679), (2938680, 5967347),
           (5967348, 12117689))  # fmt: skip


def set_order(names: list[str]) -> list[str]:
    """The order a libstdc++ `std::unordered_set<std::string>` iterates `names` inserted in
    order (bits/hashtable.h `_M_insert_bucket_begin`, `_M_rehash_aux`): a new node goes to the
    front of its bucket's run, or to the front of the list when its bucket is empty; a rehash
    relinks the nodes in list order the same way."""
    if len(names) > _REHASH[-1][0]:
        raise FormatError(f"a torch.save archive of {len(names)} records: more than this writer orders")
    codes = [_std_hash(n.encode()) for n in names]
    nxt: list[int | None] = [None] * len(names)
    state = {"head": None}
    before = -1  # the list's head sentinel (`_M_before_begin`)

    def after(node: int) -> int | None:
        return state["head"] if node == before else nxt[node]

    def link(prev: int, node: int) -> None:
        if prev == before:
            state["head"] = node
        else:
            nxt[prev] = node

    buckets: dict[int, int] = {}
    count = 1
    growth = iter(_REHASH)
    pending = next(growth)
    for i in range(len(names)):
        if i + 1 == pending[0]:
            count = pending[1]
            pending = next(growth, (0, 0))
            p, state["head"], buckets, first = state["head"], None, {}, 0
            while p is not None:
                following, b = nxt[p], codes[p] % count
                if b not in buckets:
                    nxt[p], state["head"] = state["head"], p
                    buckets[b] = before
                    if nxt[p] is not None:
                        buckets[first] = p
                    first = b
                else:
                    nxt[p] = after(buckets[b])
                    link(buckets[b], p)
                p = following
        b = codes[i] % count
        if b in buckets:
            nxt[i] = after(buckets[b])
            link(buckets[b], i)
        else:
            nxt[i], state["head"] = state["head"], i
            if nxt[i] is not None:
                buckets[codes[nxt[i]] % count] = i
            buckets[b] = before
    out, p = [], state["head"]
    while p is not None:
        out.append(names[p])
        p = nxt[p]
    return out


def serialization_id(names: list[str], crcs: list[int | None]) -> bytes:
    """`PyTorchStreamWriter::writeSerializationId`: 20 digits of the record names' hashes folded
    in the order its `files_written_` set iterates them (`set_order`), 20 of the non-empty
    records' CRC-32s folded in order."""
    name_hash = 0
    for name in set_order(names):
        name_hash = _combine(name_hash, _std_hash(name.encode()))
    crc_hash = 0
    for crc in crcs:
        if crc is not None:
            crc_hash = _combine(crc_hash, crc)
    return b"%020d%020d" % (name_hash, crc_hash)


def _zip64_extra(size: int, at: int, big: bool, far: bool) -> bytes:
    fields = (struct.pack("<QQ", size, size) if big else b"") + (struct.pack("<Q", at) if far else b"")
    return struct.pack("<HH", 1, len(fields)) + fields if fields else b""


class _Records:
    """The zip records of one archive as they are appended to `out` (a `SequentialFile` or
    anything with `write` and `position`), from offset 0."""

    def __init__(self, out, name: str):
        self.out, self.prefix = out, name
        self.entries: list[tuple[bytes, int, int, int, bytes]] = []  # name, offset, crc, size, zip64

    def open(self, name: str, size: int) -> None:
        full = f"{self.prefix}/{name}".encode()
        at = self.out.position
        big, far = size >= ZIP64_AT, at >= ZIP64_AT
        z64 = _zip64_extra(size, at, big, far)
        start = at + 30 + len(full) + len(z64) + 4
        pad = -start % ALIGN
        extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = 0x808 if size else 0x800
        self.out.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(full),
                                   len(extra)) + full + extra)
        self.entries.append((full, at, 0, size, z64))

    def close(self, crc: int) -> None:
        full, at, _, size, z64 = self.entries[-1]
        self.entries[-1] = (full, at, crc, size, z64)
        if size:
            self.out.write(struct.pack("<4sIQQ", b"PK\x07\x08", crc, size, size) if z64
                           else struct.pack("<4sIII", b"PK\x07\x08", crc, size, size))

    def record(self, name: str, data: bytes) -> int:
        self.open(name, len(data))
        self.out.write(data)
        crc = zlib.crc32(data)
        self.close(crc)
        return crc

    def end(self) -> None:
        central = b""
        for full, at, crc, size, z64 in self.entries:
            big, far = size >= ZIP64_AT, at >= ZIP64_AT
            sz, ofs = (U32 if big else size), (U32 if far else at)
            central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, 0x808 if size else 0x800, 0, 0, 0,
                                   crc, sz, sz, len(full), len(z64), 0, 0, 0, 0, ofs) + full + z64
        n, cd_at = len(self.entries), self.out.position
        z64_at = cd_at + len(central)
        self.out.write(central)
        self.out.write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, n, n, len(central), cd_at))
        self.out.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, z64_at, 1))
        self.out.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(n, U16), min(n, U16),
                                   min(len(central), U32), min(cd_at, U32), 0))


def _stream(out, t: LazyTensor, crc: list[int]) -> None:
    """`t`'s C-order little-endian bytes appended to `out`: copied file to file where they lie in
    order in the source (`lazy.copy_runs`), else read whole (`materialize`: a read-ahead view
    gives its prefetched array) up to `WRITE_BLOCK_BYTES`, in row blocks of that size above; their
    CRC-32 folded into `crc[0]`."""

    class _Fold:
        def __init__(self, inner=None):
            self.inner = inner

        def feed(self, view) -> None:
            crc[0] = zlib.crc32(view, crc[0])
            if self.inner is not None:
                self.inner.feed(view)

    runs = lazy.copy_runs(t)
    if runs is not None:
        for r in runs:
            out.copy_run(r.source, r.offset, r.nbytes, _Fold(r.check))
        return
    from hybridckpt.lazy.parallel import read_box_parallel

    shape = tuple(t.shape)
    row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(t.dtype).itemsize if shape else 0
    if t.nbytes <= WRITE_BLOCK_BYTES or row == 0:  # whole (a read-ahead view takes its prefetched array)
        pieces = [t.materialize]
    else:
        step = max(1, WRITE_BLOCK_BYTES // row)
        rest = tuple((0, n) for n in shape[1:])
        pieces = ((lambda a=a: read_box_parallel(t, ((a, min(shape[0], a + step)), *rest))) for a in range(0, shape[0], step))
    for read in pieces:
        arr = np.ascontiguousarray(read())
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        raw = arr.reshape(-1).view(np.uint8)
        _Fold().feed(raw)
        out.write(raw)
        del arr, raw


def write_archive(out, value, tensors: Tensors, *, name: str = "archive",
                  on_tensor: Callable[[LazyTensor], None] | None = None) -> int:
    """Write `torch.save(value)` to `out` (a fresh `io.sequential_file.SequentialFile`): `value`
    holds `tensors.ref(...)` where its tensors go (the module doc). `name`: the archive's folder
    (torch: the file name without `.pt`). `on_tensor(t)` after each tensor. Returns the bytes
    written."""
    pickled = emit.dumps(value, protocol=2)
    z = _Records(out, name)
    done = [("data.pkl", z.record("data.pkl", pickled))]
    done += [(n, z.record(n, data)) for n, data in _FIXED]
    for s in tensors.stored:
        nbytes = int(s.tensor.nbytes)
        z.open(f"data/{s.key}", nbytes)
        crc = [0]
        if nbytes:
            _stream(out, s.tensor, crc)
        z.close(crc[0])
        done.append((f"data/{s.key}", crc[0] if nbytes else None))
        if on_tensor is not None:
            on_tensor(s.tensor)
    crc_v = z.record(*_VERSION)
    names = [n for n, _ in done] + [_VERSION[0]]
    z.record(_SID, serialization_id(names, [c for _, c in done] + [crc_v]))
    z.end()
    return out.position
