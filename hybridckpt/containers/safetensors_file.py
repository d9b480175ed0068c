"""safetensors files, read lazily and written tensor by tensor.

Format (huggingface/safetensors README "Format"): 8 bytes little-endian u64 `N`, then `N` bytes of
UTF-8 JSON `{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`, then the data buffer; offsets are relative to the buffer start. Rules checked here:
the header fits in the file and is at most 100 MB, shapes and offsets are JSON integers, every
entry's byte length equals `prod(shape) * itemsize`, entries lie inside the buffer and do not
overlap, no name appears twice, `__metadata__` values are strings.

Reading returns `StoredTensor`s: a box reads only its bytes. Writing streams: the header is
computed from shapes first, then each tensor is read (one at a time) and written at its offset,
so peak memory is one tensor, not the file. A tensor whose bytes already lie in files as they
must be written (`lazy.copy_runs`: a DCP chunk, a dim-0 shard) is copied as it is, never
materialised as a tensor. The file is written front to back through two aligned buffers with
O_DIRECT (`io.sequential_file`: the device's write overlaps reading the next tensor, and no
page-cache copy), or through the page cache with `direct_io=False` (runs then copied file to file
by the kernel, writeback started as it goes).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from hybridckpt.errors import FormatError, short_repr
from hybridckpt.io import timing
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.io.sequential_file import SequentialFile
from hybridckpt.lazy import LazyTensor, StoredTensor, copy_runs, shape_problem

MAX_HEADER = 100 * 1024 * 1024
MAX_TENSORS = 1 << 18  # tensors one file may hold: real shards hold a few thousand, DeepSeek-V3
# whole ~92k; a 96 MB header of 1.4M one-element tensors took 32-94 s to inspect, 300+ to plan

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype) -> str:
    """The safetensors dtype string of a numpy dtype."""
    dt = np.dtype(dtype)
    try:
        return _NAMES[dt.newbyteorder("<") if dt.byteorder == ">" else dt]
    except KeyError:
        raise FormatError(f"dtype {dtype} cannot be stored in safetensors") from None


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed safetensors header: tensors as lazy views and the `__metadata__` strings."""

    path: str
    tensors: Mapping[str, StoredTensor]
    metadata: Mapping[str, str]


def read_header(path: str) -> SafetensorsFile:
    """Parse and check the header of `path`; returns lazy tensors (no tensor bytes are read)."""
    src = ByteSource(path)
    size = src.size()
    if size < 8:
        raise FormatError(f"{path}: {size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", src.read(0, 8))
    if n > MAX_HEADER or 8 + n > size:
        raise FormatError(f"{path}: header length {n} does not fit the file of {size} bytes")
    raw = src.read(8, n)
    # an upper bound of the entries, counted in C before any parse: every entry names its offsets
    if raw.count(b'"data_offsets"') > MAX_TENSORS:
        raise FormatError(
            f"{path}: header of {n} bytes holds about {raw.count(b'data_offsets')} tensors, more "
            f"than the {MAX_TENSORS} one safetensors file may hold here; refused before parsing"
        )
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise FormatError(f"{path}: header names {e.args[0]!r} twice") from None
    except (ValueError, RecursionError) as e:  # (bad UTF-8, bad JSON, an int of 4300+ digits)
        raise FormatError(f"{path}: header is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    base = 8 + n
    buffer_len = size - base
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: __metadata__ is not an object")
    tensors: dict[str, StoredTensor] = {}
    spans = []
    for name, info in header.items():
        try:
            dt = DTYPES[info["dtype"]]
            shape = _ints(info["shape"])
            begin, end = _ints(info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(
                f"{path}: tensor {short_repr(name)}: expected dtype (one of {sorted(DTYPES)}), shape and "
                f"data_offsets, found {short_repr(info)}"
            ) from None
        problem = shape_problem(shape)
        if problem is not None:
            raise FormatError(f"{path}: tensor {short_repr(name)}: {problem}")
        want = math.prod(shape) * dt.itemsize
        if not (0 <= begin <= end <= buffer_len) or end - begin != want:
            raise FormatError(
                f"{path}: tensor {short_repr(name)}: data_offsets [{begin}, {end}) do not hold {shape} "
                f"{info['dtype']} ({want} bytes) inside a buffer of {buffer_len} bytes"
            )
        spans.append((begin, end, name))
        tensors[name] = StoredTensor(src, base + begin, shape, dt)
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise FormatError(f"{path}: tensors {short_repr(n0)} and {short_repr(n1)} overlap")
    if not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{path}: __metadata__ values must be strings")
    return SafetensorsFile(path, tensors, dict(meta))


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list) -> dict:
    out = dict(pairs)  # in C; only a header with a duplicate key walks the pairs again
    if len(out) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def _ints(values) -> tuple[int, ...]:
    """A JSON list of integers (not floats, not booleans), else TypeError."""
    if type(values) is not list:
        raise TypeError("expected a list of integers")
    out = tuple(values)
    for v in out:  # json gives exact ints (bools are not `int` here: `type(True) is bool`)
        if type(v) is not int:
            raise TypeError("expected a list of integers")
    return out


def write(
    path: str,
    tensors: Mapping[str, LazyTensor | np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    on_tensor: Callable[[str, int], None] | None = None,
    direct_io: bool = True,
) -> int:
    """Write `tensors` (lazy or in memory) to `path` one at a time and fsync it; returns bytes
    written.

    `on_tensor(name, nbytes)` is called after each tensor (progress). Names are sorted like the
    safetensors library does, so files compare equal byte for byte. `direct_io`: written with
    O_DIRECT through two aligned buffers (`io.sequential_file`; False: through the page cache).
    """
    names = sorted(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = math.prod(t.shape) * np.dtype(t.dtype).itemsize
        header[name] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the buffer to 8 bytes like the reference writer
    with SequentialFile(path, direct=direct_io) as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for name in names:
            t = tensors[name]
            runs = copy_runs(t) if isinstance(t, LazyTensor) else None
            if runs is not None:  # stored bytes as they are: never materialised as a tensor
                for r in runs:
                    out.copy_run(r.source, r.offset, r.nbytes, r.check)
                nbytes = sum(r.nbytes for r in runs)
            else:
                nbytes = 0
                for arr in _row_blocks(t):  # a large lazy tensor in blocks of rows: bounded memory
                    arr = np.ascontiguousarray(arr)
                    if arr.dtype.byteorder == ">":
                        arr = arr.astype(arr.dtype.newbyteorder("<"))
                    out.write(arr.reshape(-1).view(np.uint8))
                    nbytes += arr.nbytes
                    del arr
            if on_tensor:
                on_tensor(name, nbytes)
    return 8 + len(blob) + offset


WRITE_BLOCK_BYTES = 64 << 20  # a lazy tensor larger than this is read and written in row blocks


def _row_blocks(t):
    """`t` whole, or for a lazy tensor over WRITE_BLOCK_BYTES its C-order blocks of leading rows
    of at most that size (at least one row), each read by the reader pool."""
    if not isinstance(t, LazyTensor):
        yield np.asarray(t)
        return
    from hybridckpt.lazy.parallel import read_box_parallel

    row = math.prod(t.shape[1:]) * np.dtype(t.dtype).itemsize
    if t.nbytes <= WRITE_BLOCK_BYTES or not t.shape or row == 0:
        with timing.stage("read"):  # (a tensor read ahead by the pool: this thread waits for it here)
            whole = t.materialize()
        yield whole
        return
    step = max(1, WRITE_BLOCK_BYTES // row)
    rest = tuple((0, n) for n in t.shape[1:])
    for a in range(0, t.shape[0], step):
        yield read_box_parallel(t, ((a, min(t.shape[0], a + step)), *rest))


def plan_shards(
    sizes: Iterable[tuple[str, int]], max_shard_bytes: int
) -> list[list[str]]:
    """Group `(name, nbytes)` in order into shards of at most `max_shard_bytes` (a tensor larger
    than the limit gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return [s for s in shards if s]
