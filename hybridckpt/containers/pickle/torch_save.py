"""Read `torch.save` files without torch: nested Python objects with `LazyTensor` leaves.

Zip format (torch >= 1.6; pytorch/pytorch: torch/serialization.py `_save`/`_load`,
caffe2/serialize/inline_container.cc):
- A ZIP archive whose entries are all STORED (never compressed) under one top folder of any
  name, `<name>/`. Local headers may carry padding in their extra field (torch aligns storage
  data to 64 bytes), so an entry's data starts at `header + 30 + name_len + extra_len` of its
  LOCAL header, not the central one.
- `<name>/data.pkl`: the pickled object (protocol 2). `<name>/data/<key>`: one storage per key,
  raw elements. `<name>/byteorder`: `little` (absent in older files: little). Also `version`,
  `.format_version`, `.storage_alignment`, `.data/serialization_id` (unused here).
- Tensors and storages in the pickle: see `torch_tensors`. A storage is the persistent id
  `('storage', T, key, location, numel)`; its bytes are the entry `<name>/data/<key>`.
- An archive may be embedded at a byte offset of a larger file (torch DCP `.distcp` chunks):
  `load(path, base_offset=, length=)` parses the window; file offsets stay absolute.

Legacy format (torch < 1.6 or `_use_new_zipfile_serialization=False`; torch/serialization.py
`_legacy_save`): five pickles back to back (magic number 0x1950a86a20f9469cfc6c, protocol
version 1001, sys_info `{little_endian, type_sizes}`, the object with persistent ids
`('storage', T, key, location, numel, view_metadata)`, the list of storage keys), then for each
key in that list an int64 element count and the storage's raw bytes.

Only `data.pkl` (or the legacy pickles), the zip directory and the local headers of the
storages the pickle names are read at load time; tensor bytes are read when a box is read.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib

from hybridckpt.containers.pickle.allow import Policy
from hybridckpt.containers.pickle.machine import safe_loads
from hybridckpt.containers.pickle.opcodes import Truncated, check_pickle
from hybridckpt.containers.pickle.torch_policy import TorchDtype
from hybridckpt.containers.pickle.torch_tensors import TORCH_SAVE_POLICY, Storage, unpickle_tensors
from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import ByteSource

__all__ = ["load", "load_source", "is_torch_zip", "is_torch_legacy", "unchecked_ranges"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001


# -- zip container ---------------------------------------------------------------------------


class _Window(io.RawIOBase):
    """Bytes `[base, base + length)` of a ByteSource as a seekable file (every read counted)."""

    def __init__(self, source: ByteSource, base: int, length: int):
        self._src, self._base, self._len, self._pos = source, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        start = {0: 0, 1: self._pos, 2: self._len}[whence]
        if start + offset < 0:
            raise OSError("seek before the start of the archive")
        self._pos = start + offset
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._len - self._pos))
        if n:
            self._src.read_into(self._base + self._pos, memoryview(buffer).cast("B")[:n])
            self._pos += n
        return n


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


class _Zip:
    """The entries of a torch.save zip in `[base, base + length)` of `path`."""

    def __init__(self, source: ByteSource, base: int, length: int, name: str):
        self.src, self.base, self.length, self.name = source, base, length, name
        try:
            with zipfile.ZipFile(_Window(source, base, length)) as zf:
                infos = zf.infolist()
        except (
            zipfile.BadZipFile,
            zipfile.LargeZipFile,
            OSError,
            EOFError,
            ValueError,
            struct.error,
            NotImplementedError,  # "zip file version 22.9": a corrupt version field
        ) as e:
            raise FormatError(f"{name}: not a readable zip archive (truncated?): {e}") from e
        self.entries: dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            if info.filename in self.entries:
                raise FormatError(f"{name}: duplicate zip entry '{info.filename}'")
            self.entries[info.filename] = info
        pkls = [n for n in self.entries if n.endswith("/data.pkl") and n.count("/") == 1]
        if not pkls:
            raise FormatError(f"{name}: no '<name>/data.pkl' entry: not a torch.save archive")
        first = infos[0].filename.split("/", 1)[0]
        self.prefix = (f"{first}/data.pkl" if f"{first}/data.pkl" in pkls else pkls[0])[
            : -len("/data.pkl")
        ]
        self.infos, self.start_dir = infos, getattr(zf, "start_dir", None)

    def entry(self, rel: str) -> zipfile.ZipInfo | None:
        return self.entries.get(f"{self.prefix}/{rel}")

    def data_offset(self, info: zipfile.ZipInfo) -> int:
        """Absolute file offset of a STORED entry's data (checks its local header)."""
        where = f"{self.name}: entry '{info.filename}'"
        if info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(
                f"{where} is compressed (method {info.compress_type}); torch.save stores entries uncompressed"
            )
        if info.flag_bits & 0x1:
            raise FormatError(f"{where} is encrypted")
        raw_name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        if info.header_offset < 0:
            raise FormatError(
                f"{where}: local header offset {info.header_offset} lies before the archive"
            )
        if info.header_offset + _LOCAL_HEADER.size + len(raw_name) > self.length:
            raise FormatError(
                f"{where}: local header lies past the end of the archive (truncated?)"
            )
        head = self.src.read(self.base + info.header_offset, _LOCAL_HEADER.size + len(raw_name))
        sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(head)
        if (
            sig != b"PK\x03\x04"
            or head[_LOCAL_HEADER.size :] != raw_name
            or name_len != len(raw_name)
        ):
            raise FormatError(f"{where}: bad local header at byte {self.base + info.header_offset}")
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if start + info.file_size > self.length:
            raise FormatError(
                f"{where}: data [{start}, {start + info.file_size}) lies past the end of the "
                f"archive ({self.length} bytes): truncated file?"
            )
        return self.base + start

    def read(self, info: zipfile.ZipInfo) -> bytes:
        data = self.src.read(self.data_offset(info), info.file_size)
        if zlib.crc32(data) != info.CRC:
            raise FormatError(f"{self.name}: entry '{info.filename}' fails its CRC check")
        return data


def _load_zip(src: ByteSource, base: int, length: int, name: str, policy: Policy) -> object:
    z = _Zip(src, base, length, name)
    order = z.entry("byteorder")
    if order is not None:
        value = z.read(order)
        if value != b"little":
            raise FormatError(
                f"{name}: byteorder is {value[:16]!r}; only little-endian torch files are supported"
            )
    pkl = z.entry("data.pkl")
    located: dict[str, tuple[int, int]] = {}

    def resolve(key: str, dtype: TorchDtype, nbytes: int, view) -> Storage:
        what = f"{name}:data/{key}"
        if view is not None:
            raise FormatError(f"{what}: storage views are only valid in legacy files")
        if key not in located:
            info = z.entry(f"data/{key}")
            if info is None:
                raise FormatError(
                    f"{name}: the pickle names storage '{key}' but entry "
                    f"'{z.prefix}/data/{key}' is missing"
                )
            located[key] = (z.data_offset(info), info.file_size)
        offset, size = located[key]
        if nbytes > size:
            raise FormatError(
                f"{what}: storage of torch.{dtype.name} claims {nbytes} bytes, entry holds {size}"
            )
        return Storage(src, offset, nbytes, dtype, what)

    return unpickle_tensors(z.read(pkl), f"{name}:data.pkl", policy, resolve)


# -- legacy container ------------------------------------------------------------------------


def _legacy_pickles(src: ByteSource, base: int, length: int, name: str) -> tuple[bytes, list[int]]:
    """The head of the file holding the five legacy pickles, and their end offsets."""
    want = min(length, 1 << 16)
    while True:
        buf = src.read(base, want)
        ends, pos = [], 0
        try:
            for _ in range(5):
                pos = check_pickle(buf, pos, what=name, stream_end=length)
                ends.append(pos)
            return buf, ends
        except Truncated:
            if want >= length:
                raise
            want = min(length, want * 4)


def _load_legacy(src: ByteSource, base: int, length: int, name: str, policy: Policy) -> object:
    buf, ends = _legacy_pickles(src, base, length, name)
    starts = [0] + ends[:-1]
    part = [buf[a:b] for a, b in zip(starts, ends, strict=True)]
    magic = safe_loads(part[0], what=f"{name}:magic")
    proto = safe_loads(part[1], what=f"{name}:protocol")
    sys_info = safe_loads(part[2], what=f"{name}:sys_info")
    if magic != LEGACY_MAGIC or proto != LEGACY_PROTOCOL:
        raise FormatError(f"{name}: bad legacy torch header (magic {magic!r}, protocol {proto!r})")
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
        raise FormatError(f"{name}: legacy file is not little-endian ({sys_info!r})")
    keys = safe_loads(part[4], what=f"{name}:storage keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise FormatError(f"{name}: legacy storage key list is {type(keys).__name__}")
    what_obj = f"{name}:pickle"

    # pass 1: which dtype and size each root storage has (only the pickle knows)
    roots: dict[str, tuple[TorchDtype, int]] = {}

    def record(key, dtype, nbytes, view):
        roots.setdefault(key, (dtype, nbytes))
        return Storage(src, 0, nbytes, dtype, f"{name}:storage {key}")

    unpickle_tensors(part[3], what_obj, policy, record)

    located: dict[str, int] = {}
    pos = ends[4]
    for key in keys:
        if key not in roots:
            raise FormatError(f"{name}: storage key {key!r} is listed but no tensor uses it")
        dtype, nbytes = roots[key]
        if pos + 8 > length:
            raise FormatError(
                f"{name}: storage {key!r} header at byte {pos} is past the end (truncated)"
            )
        (count,) = struct.unpack("<q", src.read(base + pos, 8))
        if count * dtype.itemsize != nbytes:
            raise FormatError(
                f"{name}: storage {key!r} has {count} elements on disk, the pickle says {nbytes // dtype.itemsize}"
            )
        located[key] = base + pos + 8
        pos += 8 + nbytes
        if pos > length:
            raise FormatError(f"{name}: storage {key!r} runs past the end of the file (truncated)")

    def resolve(key, dtype, nbytes, view):
        what = f"{name}:storage {key}"
        if key not in located:
            raise FormatError(f"{name}: the pickle names storage {key!r} but it is not in the file")
        root_dtype, root_nbytes = roots[key]
        offset = located[key]
        if view is not None:
            view_key, view_offset, view_size = view
            offset += view_offset * dtype.itemsize
            if view_offset < 0 or (view_offset + view_size) * dtype.itemsize > root_nbytes:
                raise FormatError(f"{what}: storage view {view!r} lies outside its storage")
            nbytes, what = view_size * dtype.itemsize, f"{name}:storage {view_key}"
        elif nbytes > root_nbytes:
            raise FormatError(f"{what}: claims {nbytes} bytes, stored {root_nbytes}")
        return Storage(src, offset, nbytes, dtype, what)

    return unpickle_tensors(part[3], what_obj, policy, resolve)


# -- public API ------------------------------------------------------------------------------


def _window(path, base_offset: int, length: int | None) -> tuple[ByteSource, int, int, str]:
    path = os.path.abspath(os.fspath(path))
    src = ByteSource(path)
    size = src.size()
    if length is None:
        length = size - base_offset
    if base_offset < 0 or length < 0 or base_offset + length > size:
        raise FormatError(
            f"{path}: window [{base_offset}, {base_offset}+{length}) is outside the file ({size} bytes)"
        )
    name = path if (base_offset, length) == (0, size) else f"{path}@{base_offset}+{length}"
    return src, base_offset, length, name


def _kind(src: ByteSource, base: int, length: int, name: str) -> str:
    head = src.read(base, min(length, 64))
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    try:
        end = check_pickle(head, what=name, stream_end=length)
        if safe_loads(head[:end], what=name) == LEGACY_MAGIC:
            return "legacy"
    except FormatError:
        pass
    if length >= 262 and src.read(base + 257, 5) == b"ustar":
        return "tar"
    return "unknown"


def is_torch_zip(
    path: str | os.PathLike, *, base_offset: int = 0, length: int | None = None
) -> bool:
    """Whether the file (or window) is a torch.save zip archive with a `<name>/data.pkl`."""
    try:
        src, base, length, name = _window(path, base_offset, length)
        if _kind(src, base, length, name) != "zip":
            return False
        _Zip(src, base, length, name)
        return True
    except FormatError:
        return False


def is_torch_legacy(
    path: str | os.PathLike, *, base_offset: int = 0, length: int | None = None
) -> bool:
    """Whether the file starts with the legacy (pre-1.6) torch.save magic number pickle."""
    try:
        src, base, length, name = _window(path, base_offset, length)
        return _kind(src, base, length, name) == "legacy"
    except FormatError:
        return False


def load(
    path: str | os.PathLike,
    *,
    base_offset: int = 0,
    length: int | None = None,
    policy_extra: Policy | None = None,
) -> object:
    """The object saved by `torch.save` in `path`, tensors as lazy `LazyTensor` leaves.

    `base_offset`/`length` (bytes) select an archive embedded in a larger file. `policy_extra`
    adds allowed globals or stub prefixes to `TORCH_SAVE_POLICY`. Parameters come back as their
    tensor; `torch.Size` as a tuple, dtypes as `TorchDtype`, `torch.device` as a string.
    Raises `FormatError` (file and key named) on any malformed input, `UnsafePickleError` for
    globals outside the policy.
    """
    src, base, length, name = _window(path, base_offset, length)
    return load_source(src, base, length, name, policy_extra)


def load_source(src, base: int, length: int, name: str, policy_extra: Policy | None = None) -> object:
    """`load` of the archive at `[base, base + length)` of `src` (`read(offset, n)`,
    `read_into(offset, buffer)`: a `ByteSource`, or bytes already read, `formats.dcp.chunk`);
    `name` is the archive's in error messages. Storages refer to `src`."""
    policy = TORCH_SAVE_POLICY.merged(policy_extra)
    kind = _kind(src, base, length, name)
    if kind == "zip":
        return _load_zip(src, base, length, name, policy)
    if kind == "legacy":
        return _load_legacy(src, base, length, name, policy)
    if kind == "tar":
        raise FormatError(f"{name}: the pre-0.4 tar torch.save format is not supported")
    raise FormatError(f"{name}: neither a torch.save zip archive nor a legacy torch.save file")


def unchecked_ranges(src, length: int, name: str) -> list[tuple[int, int]] | None:
    """The byte ranges `[start, end)` (relative to `base_offset`) of a torch.save zip archive that
    `load` neither reads nor checks: the data of every entry but `data.pkl` and `byteorder` (a
    storage's elements, `.data/serialization_id`, which differs per save) and those entries' CRC-32
    fields in their local and central headers and data descriptors. Two archives of one length equal outside these
    ranges load to the same object, its storages at the same relative offsets (`dcp.chunk`). None
    when the layout is not the plain one (a directory not where zipfile found it). `src`: the
    archive's bytes from 0 (`read(offset, n)`, `read_into(offset, buffer)`: a `ByteSource`, or the
    bytes already read)."""
    base = 0
    z = _Zip(src, base, length, name)
    if z.start_dir is None:
        return None
    kept = {f"{z.prefix}/data.pkl", f"{z.prefix}/byteorder"}
    out, pos = [], z.start_dir
    for info in z.infos:  # central records in directory order: 46 bytes, name, extra, comment
        if pos + 46 > length or src.read(base + pos, 4) != b"PK\x01\x02":
            return None
        if info.filename not in kept:
            start = z.data_offset(info) - base
            out += [(info.header_offset + 14, info.header_offset + 18), (start, start + info.file_size),
                    (pos + 16, pos + 20)]
            if info.flag_bits & 0x8:  # a data descriptor after the data: [signature], CRC, sizes
                end = start + info.file_size
                crc = end + 4 if src.read(base + end, 4) == b"PK\x07\x08" else end
                out.append((crc, crc + 4))
        pos += 46 + len(info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"))
        pos += len(info.extra) + len(info.comment)
    return sorted(out)


def zip_pickle(path: str | os.PathLike) -> bytes | None:
    """The `data.pkl` bytes of a torch.save zip archive (CRC-checked), unparsed; None when the
    file is not a zip archive. Two archives whose pickles are equal hold the same objects (their
    storage bytes aside): a reader of many rank files that are copies of one another parses one
    and compares the others' pickles (DeepSpeed ZeRO-3's per-rank model states)."""
    src, base, length, name = _window(path, 0, None)
    if _kind(src, base, length, name) != "zip":
        return None
    z = _Zip(src, base, length, name)
    return z.read(z.entry("data.pkl"))
