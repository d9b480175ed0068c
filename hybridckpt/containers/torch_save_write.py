"""`torch.save` archives WRITTEN without torch: one tensor (streamed) or one plain value.

What `torch.save(x, stream)` writes (pytorch/pytorch: torch/serialization.py `_save`,
caffe2/serialize/inline_container.cc `PyTorchStreamWriter`, miniz), byte for byte, for the two
kinds of archive a DCP `.distcp` file and a Megatron ShardedObject hold:

- a zip of stored (uncompressed) records under the folder `archive/`, in this order:
  `data.pkl` (the pickle, protocol 2), `.format_version` (`1`), `.storage_alignment` (`64`),
  `byteorder` (`little`), `data/0` (a tensor's bytes; absent for a plain value), `version`
  (`3\\n`), `.data/serialization_id`;
- every local header has flags 0x808 (sizes in a data descriptor after the data, UTF-8 names;
  0x800 and no descriptor for an empty record), version, time, CRC and sizes 0, and an extra field `FB` + u16 n + n bytes `Z` so that the
  record's data starts at a multiple of 64 bytes from the archive's start; after the data, the
  16-byte descriptor `PK\\7\\8`, CRC-32, size, size;
- then the central directory (one entry per record, the same fields, the local header's
  offset), a zip64 end record (made by 0x031e, needs 45), its locator and the end record;
- the tensor pickle is `torch._utils._rebuild_tensor_v2(persistent_load(('storage',
  torch.<T>Storage, '0', 'cpu', numel)), 0, shape, C strides, False, OrderedDict())`;
- `.data/serialization_id` is 20 digits of a hash combining the record names (libstdc++'s
  `std::hash<std::string>` of each, folded with `c10::hash_combine` in the reverse of their
  order: the order a small `std::unordered_set` iterates) and 20 digits of the same fold of
  the non-empty records' CRC-32s in order (`PyTorchStreamWriter::writeSerializationId`).

A tensor archive is written in three pieces so its data never has to be in memory at once:
`TensorArchive.head` (everything before the data), the data (the caller streams it, folding
its CRC-32 with `zlib.crc32`), then `tail(crc)`. Archives stay under 4 GiB (no zip64 records
per entry: a caller splits larger tensors into row blocks, as DCP chunks).
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from hybridckpt.containers.pickle import emit
from hybridckpt.containers.pickle.torch_policy import TORCH_DTYPES
from hybridckpt.errors import FormatError

ALIGN = 64
MAX_ARCHIVE = 2**32 - 2**20  # bytes: kept below zip64 sizes with room for the records
_FIXED = [(".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")]
_VERSION = ("version", b"3\n")
_SID = ".data/serialization_id"
STORAGE_CLASSES = {  # numpy dtype name -> torch's legacy storage class (torch/storage.py)
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
}
_TORCH_NAME = {np.dtype(d.numpy): n for n, d in TORCH_DTYPES.items() if d.numpy is not None}


def torch_dtype_name(dtype) -> str:
    """torch's name of a numpy dtype (`float32`, `bfloat16`, ...); a FormatError where torch has none."""
    name = _TORCH_NAME.get(np.dtype(dtype))
    if name is None:
        raise FormatError(f"dtype {np.dtype(dtype)} has no torch dtype to write")
    return name


# -- the serialization id ------------------------------------------------------------------------

_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def _std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s `std::_Hash_bytes` (64-bit size_t): the hash of `std::hash<std::string>`."""
    n = len(data)
    aligned = n & ~7
    h = (seed ^ (n * _MUL)) & _M64
    for p in range(0, aligned, 8):
        h ^= (_shift_mix((int.from_bytes(data[p : p + 8], "little") * _MUL) & _M64) * _MUL) & _M64
        h = (h * _MUL) & _M64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _M64
    return _shift_mix((_shift_mix(h) * _MUL) & _M64)


def _combine(seed: int, value: int) -> int:
    """`c10::hash_combine`."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _M64)) & _M64


def _serialization_id(names: list[str], crcs: list[int | None]) -> bytes:
    name_hash = 0
    for name in reversed(names):
        name_hash = _combine(name_hash, _std_hash(name.encode()))
    crc_hash = 0
    for crc in crcs:
        if crc is not None:  # (an empty record is not folded in)
            crc_hash = _combine(crc_hash, crc)
    return b"%020d%020d" % (name_hash, crc_hash)


# -- the zip records -------------------------------------------------------------------------------


def _local_header(name: bytes, at: int, flags: int) -> bytes:
    start = (
        at + 30 + len(name) + 4
    )  # the data after the header, its name and the FB field's own 4 bytes
    pad = -start % ALIGN
    extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return (
        struct.pack(
            "<4sHHHHHIIIHH", b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)
        )
        + name
        + extra
    )


def _descriptor(crc: int, size: int) -> bytes:
    return struct.pack("<4sIII", b"PK\x07\x08", crc, size, size)


def _flags(size: int) -> int:
    return 0x808 if size else 0x800


class _Zip:
    """The records of one archive, laid out as they are appended (offsets from its start)."""

    def __init__(self):
        self.at = 0
        self.entries: list[tuple[bytes, int, int, int]] = []  # (name, header offset, crc, size)

    def record(self, name: str, data: bytes) -> bytes:
        head = self.open(name, len(data))
        return head + data + self.close(zlib.crc32(data), len(data))

    def open(self, name: str, size: int) -> bytes:
        """The local header of a record of `size` bytes (an empty one has no data descriptor:
        flags 0x800, as miniz writes it)."""
        full = f"archive/{name}".encode()
        head = _local_header(full, self.at, _flags(size))
        self.entries.append((full, self.at, 0, 0))
        self.at += len(head)
        return head

    def close(self, crc: int, size: int) -> bytes:
        full, at, _, _ = self.entries[-1]
        self.entries[-1] = (full, at, crc, size)
        self.at += size + (16 if size else 0)
        return _descriptor(crc, size) if size else b""

    def end(self) -> bytes:
        central = b"".join(
            struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, _flags(size), 0, 0, 0, crc, size, size, len(name),
                        0, 0, 0, 0, 0, at) + name
            for name, at, crc, size in self.entries
        )  # fmt: skip
        n, cd_at, z64_at = len(self.entries), self.at, self.at + len(central)
        z64 = struct.pack(
            "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, n, n, len(central), cd_at
        )
        locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, z64_at, 1)
        eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(central), cd_at, 0)
        return central + z64 + locator + eocd

    def finish(self, names_crcs: list[tuple[str, int | None]]) -> bytes:
        """The version and serialization-id records and the directory (`names_crcs`: the
        records so far, in order, with their CRC-32s)."""
        out = self.record(*_VERSION)
        names = [n for n, _ in names_crcs] + [_VERSION[0]]
        crcs = [c for _, c in names_crcs] + [zlib.crc32(_VERSION[1])]
        out += self.record(_SID, _serialization_id(names, crcs))
        return out + self.end()


def _front(z: _Zip, pickled: bytes) -> tuple[bytes, list[tuple[str, int]]]:
    out = z.record("data.pkl", pickled)
    done = [("data.pkl", zlib.crc32(pickled))]
    for name, data in _FIXED:
        out += z.record(name, data)
        done.append((name, zlib.crc32(data)))
    return out, done


def object_archive(value) -> bytes:
    """`torch.save(value)` of a plain value (what `emit.dumps` writes: None, bool, int, float,
    str, tuple, list, dict and `emit` objects), as bytes."""
    z = _Zip()
    out, done = _front(z, emit.dumps(value, protocol=2))
    return out + z.finish(done)


class TensorArchive:
    """`torch.save` of one C-contiguous CPU tensor of `shape` and numpy `dtype`, in pieces:
    `head`, then the tensor's `nbytes` bytes (little-endian, C order), then `tail(crc)` with
    their CRC-32 (`zlib.crc32`). `length` is the whole archive's size in bytes."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        storage = STORAGE_CLASSES.get(self.dtype.name)
        if storage is None:
            raise FormatError(f"dtype {self.dtype} has no torch storage class to write")
        numel = math.prod(self.shape)
        self.nbytes = numel * self.dtype.itemsize
        strides = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        pid = emit.PersistentId(("storage", emit.Global("torch", storage), "0", "cpu", numel))
        ordered = emit.Reduce(emit.Global("collections", "OrderedDict"), ())
        pickled = emit.dumps(
            emit.Reduce(emit.Global("torch._utils", "_rebuild_tensor_v2"),
                        (pid, 0, self.shape, strides, False, ordered)),
            protocol=2,
        )  # fmt: skip
        if self.nbytes + 4096 > MAX_ARCHIVE:
            raise FormatError(
                f"a torch.save archive of a {self.nbytes}-byte tensor: split the tensor (at most "
                f"{MAX_ARCHIVE} bytes an archive)"
            )
        self._zip = _Zip()
        front, self._done = _front(self._zip, pickled)
        self.head = front + self._zip.open("data/0", self.nbytes)
        self.length = len(self.head) + self.nbytes + len(self.tail(0))

    def tail(self, crc: int) -> bytes:
        """Everything after the data, given the data's CRC-32 (its length does not depend on it)."""
        z = _Zip()
        z.at, z.entries = self._zip.at, list(self._zip.entries)
        out = z.close(crc, self.nbytes)
        return out + z.finish([*self._done, ("data/0", crc if self.nbytes else None)])
