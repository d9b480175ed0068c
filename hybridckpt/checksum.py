"""Per-tensor checksums that do not depend on how a tensor is sharded.

checksum(T) = sum over elements i of mix(i, bits(T[i])) mod 2^64, where i is the global C-order
flat index, bits the element's raw bits (zero-extended to 64) and mix is splitmix64's finaliser
of `i * 0x9E3779B97F4A7C15 ^ bits`. Because it is a sum, every device's box adds its own part
(boxes holding the same data are counted once), so an import computes it from the boxes it
reads anyway, and `verify` recomputes it from any mesh. A flipped bit or two swapped elements
change it (with probability 1 - 2^-64 for random damage); it is not a cryptographic hash.

`box_part` walks a box as its maximal contiguous runs (`lazy.box_runs`) in blocks of `BLOCK`
elements, using two preallocated uint64 buffers and in-place numpy ops (so the working set stays
in cache), and derives `i * GOLDEN` as `start * GOLDEN + j * GOLDEN` (mod 2^64) without
materialising the indices. The plain definition (every index of a box built at once, about 40x
slower: 0.02 vs 0.7 GB/s on one core for a `[1, 2048, 5632]` bf16 tile) is kept as the test
oracle `tests/oracles/checksum_reference.py`; tests check both agree bit for bit.

Two definitions; `trainer_state["checksum_algorithm"]` says which an import recorded (absent:
the first, which imports before 2026-11 recorded):

- `ELEMENTS` ("elements-splitmix64"), above: `box_part` / `of_array`. Independent of any grid,
  but about 11 uint64 passes per element: 0.5 G elements/s a core, the largest single cost of a
  bf16 import (about 1.4 of 4.3 s for 1.1 GiB on 2 cores). Still what `place` sums and what
  `verify` checks for older imports.
- `CHUNKS` ("chunks-crc32"), what `hybridckpt import` records: the tensor is cut on a grid of
  `chunk`-shaped boxes (the stored zarr chunks, recorded per tensor in
  `trainer_state["checksum_chunks"]`, clipped at the tensor's edge), and
  checksum(T) = sum over grid boxes b of splitmix64(index(b) << 32 | crc32(bytes of T[b])) mod 2^64,
  with index(b) the box's C-order position on the grid and the bytes the box's elements in C
  order (little-endian raw bits). zlib's CRC-32, computed by zlib-ng (carry-less multiply
  folding: about 65 GB/s a core here, against 6.7 for the system zlib 1.2 and 0.5 G elements/s
  for the element mix) with the GIL released; CRC-32 is the per-block integrity check of zip,
  gzip and TensorStore's own OCDBT. An import writes whole chunks anyway, so it adds each
  chunk's part as it writes it; `verify` reads the same grid boxes from whatever is on disk (any later chunk
  layout, any codec), so a re-saved checkpoint still verifies. A flipped bit, two swapped chunks
  or two swapped elements change it (a damaged chunk escapes with probability 2^-32).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

try:  # zlib-ng's CRC-32: zlib's function, folded with PCLMULQDQ (65 GB/s a core here, zlib 1.2: 7)
    from zlib_ng.zlib_ng import crc32 as _crc32
    from zlib_ng.zlib_ng import crc32_combine as _crc32_combine
except ImportError:  # pragma: no cover - a platform without zlib-ng's wheel: the same values, slower
    from zlib import crc32 as _crc32

    _crc32_combine = None  # (the stdlib's zlib has no combine: `has_crc32_combine` is False)

from hybridckpt import lazy
from hybridckpt.lazy import Box, box_runs

ELEMENTS = "elements-splitmix64"
CHUNKS = "chunks-crc32"
ALGORITHMS = (ELEMENTS, CHUNKS)

BLOCK = 1 << 16  # elements per vectorised pass: 2 x 512 KiB of uint64 work buffers
_MASK = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15
_GOLDEN = np.uint64(_G)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix_sum(z: np.ndarray, t: np.ndarray) -> int:
    """splitmix64's finaliser of every element of `z` (in place, `t` scratch), summed mod 2^64."""
    np.right_shift(z, _S30, out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, _M1, out=z)
    np.right_shift(z, _S27, out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, _M2, out=z)
    np.right_shift(z, _S31, out=t)
    np.bitwise_xor(z, t, out=z)
    return int(z.sum(dtype=np.uint64))


def box_part(shape: tuple[int, ...], box: Box, data: np.ndarray) -> int:
    """The part of the checksum of a tensor of `shape` that the elements `data` at `box` add."""
    if data.size == 0:
        return 0
    flat = np.ascontiguousarray(data).reshape(-1)
    size = flat.dtype.itemsize
    if size not in (1, 2, 4, 8):
        raise ValueError(f"no checksum for dtype {flat.dtype}")
    bits = flat.view(f"u{size}")
    starts, run_len = box_runs(tuple(shape), box)
    z = np.empty(min(BLOCK, max(run_len, 1) * len(starts)), dtype=np.uint64)
    t = np.empty_like(z)
    total = 0
    with np.errstate(over="ignore"):
        if run_len >= BLOCK:  # long runs: blocks inside each run
            steps = np.arange(BLOCK, dtype=np.uint64) * _GOLDEN
            pos = 0
            for s in starts.tolist():
                for off in range(0, run_len, BLOCK):
                    m = min(BLOCK, run_len - off)
                    zz, tt = z[:m], t[:m]
                    np.add(steps[:m], np.uint64(((s + off) * _G) & _MASK), out=zz)
                    np.bitwise_xor(zz, bits[pos : pos + m], out=zz)
                    total += _mix_sum(zz, tt)
                    pos += m
        else:  # short runs: several whole runs per block
            per = max(1, BLOCK // run_len)
            steps = np.arange(run_len, dtype=np.uint64) * _GOLDEN
            ustarts = starts.astype(np.uint64) * _GOLDEN
            for r in range(0, len(starts), per):
                rs = ustarts[r : r + per]
                m = len(rs) * run_len
                zz, tt = z[:m], t[:m]
                np.add(rs[:, None], steps[None, :], out=zz.reshape(len(rs), run_len))
                np.bitwise_xor(zz, bits[r * run_len : r * run_len + m], out=zz)
                total += _mix_sum(zz, tt)
    return total & _MASK


def combine(parts: Iterable[int]) -> int:
    """The checksum of a tensor from the parts of disjoint boxes covering it (mod 2^64)."""
    return sum(parts) & _MASK


def of_array(x) -> int:
    """Checksum of a numpy array or a (possibly sharded) jax.Array, shard by shard (each
    distinct box of this process's shards counted once)."""
    if hasattr(x, "addressable_shards"):
        seen: set = set()
        parts = []
        for shard in x.addressable_shards:
            box = tuple(
                (s.start or 0, s.stop if s.stop is not None else n)
                for s, n in zip(shard.index, x.shape, strict=True)
            )
            if box in seen:
                continue
            seen.add(box)
            parts.append(box_part(tuple(x.shape), box, np.asarray(shard.data)))
        return combine(parts)
    x = np.asarray(x)
    return box_part(x.shape, tuple((0, n) for n in x.shape), x)


# -- CHUNKS: CRC-32 per grid box --------------------------------------------------------------


def _mix64(z: int) -> int:
    """splitmix64's finaliser of one 64-bit integer (a bijection on [0, 2^64))."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _grid(shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[int, ...]:
    """Boxes per axis of the grid of `chunk`-shaped boxes over `shape`."""
    if len(chunk) != len(shape) or any(c <= 0 < n for c, n in zip(chunk, shape, strict=True)):
        raise ValueError(f"chunk shape {list(chunk)} does not fit a tensor of shape {list(shape)}")
    return tuple(-(-n // c) if n else 0 for n, c in zip(shape, chunk, strict=True))


def grid_boxes(shape: tuple[int, ...], chunk: tuple[int, ...]) -> Iterator[Box]:
    """Every box of the grid of `chunk`-shaped boxes over `shape`, clipped at the edge, C order."""
    _grid(shape, chunk)  # (a chunk shape that does not fit: ValueError)
    return lazy.grid_boxes(lazy.full_box(shape), chunk)


def grid_index(shape: tuple[int, ...], chunk: tuple[int, ...], box: Box) -> int:
    """The C-order position on the grid of `chunk`-shaped boxes of the grid box starting at `box`."""
    grid = _grid(shape, chunk)
    index = 0
    for (a, _), c, g in zip(box, chunk, grid, strict=True):
        if a % c:
            raise ValueError(f"box {box} does not start on the grid of {chunk}")
        index = index * g + a // c
    return index


def crc32_of(data: np.ndarray) -> int:
    """zlib's CRC-32 of an array's elements in C order (little-endian raw bits)."""
    raw = np.ascontiguousarray(data)
    if raw.dtype.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"no checksum for dtype {raw.dtype}")
    return _crc32(memoryview(raw.reshape(-1).view(np.uint8)))


def crc32_update(view: memoryview, crc: int) -> int:
    """`crc` (of the bytes before) continued over `view`: a chunk's CRC-32 fed run by run."""
    return _crc32(view, crc)


def has_crc32_combine() -> bool:
    """Whether `crc32_combine` is available (zlib-ng)."""
    return _crc32_combine is not None


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of bytes A then B from `crc1` (of A), `crc2` (of B) and B's length in bytes
    (zlib's `crc32_combine`): a chunk checked from pieces read apart, in any order."""
    return _crc32_combine(crc1, crc2, len2)


def crc32_of_pieces(pieces: dict[int, tuple[int, int]], nbytes: int) -> int | None:
    """The CRC-32 of `nbytes` bytes from pieces of them (start byte -> (bytes, CRC-32)) once
    they tile them exactly; None before, or where they overlap."""
    if sum(n for n, _ in pieces.values()) != nbytes:
        return None
    crc, at = 0, 0
    for start in sorted(pieces):
        n, c = pieces[start]
        if start != at:
            return None
        crc, at = (c if at == 0 else crc32_combine(crc, c, n)), at + n
    return crc


def part_of(index: int, crc: int) -> int:
    """The part a grid box at position `index` whose elements have CRC-32 `crc` adds to the
    CHUNKS checksum."""
    return _mix64(((index << 32) | crc) & _MASK)


def chunk_part(shape: tuple[int, ...], chunk: tuple[int, ...], box: Box, data: np.ndarray) -> int:
    """The part one grid box `box` (clipped) adds to the CHUNKS checksum: `data` its elements."""
    return part_of(grid_index(shape, chunk, box), crc32_of(data))


def tile_crcs(shape: tuple[int, ...], chunk: tuple[int, ...], box: Box, data: np.ndarray) -> list[tuple[int, int]]:
    """(grid position, CRC-32) of every grid box of the tile `box` (whole grid boxes, clipped at
    the tensor's edge): `data` its elements. A grid box spanning the tile's trailing axes is a
    contiguous slice of it (no copy); any other is copied out first."""
    if data.size == 0:
        return []
    return [
        (grid_index(shape, chunk, sub), crc32_of(data[lazy.box_slices(sub, box)]))
        for sub in lazy.grid_boxes(box, chunk)
    ]


def tile_part(shape: tuple[int, ...], chunk: tuple[int, ...], box: Box, data: np.ndarray) -> int:
    """The CHUNKS part of `box`, a tile of whole grid boxes (clipped at the tensor's edge):
    `data` its elements (see `tile_crcs`)."""
    return combine(part_of(i, crc) for i, crc in tile_crcs(shape, chunk, box, data))


def grid_size(shape: tuple[int, ...], chunk: tuple[int, ...]) -> int:
    """How many grid boxes the grid of `chunk` has over `shape`."""
    return int(np.prod(_grid(shape, chunk), dtype=np.int64)) if shape else 1


def encode_crcs(crcs: np.ndarray) -> str:
    """A table of CRC-32s (uint32, grid C order) as recorded in `trainer_state["chunk_crc32"]`:
    base64 of its little-endian bytes."""
    import base64

    return base64.b64encode(np.asarray(crcs, dtype="<u4").tobytes()).decode("ascii")


def decode_crcs(text: str, count: int) -> np.ndarray | None:
    """The table `encode_crcs` wrote, if it is one of `count` entries; else None."""
    import base64
    import binascii

    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, AttributeError):
        return None
    if len(raw) != 4 * count:
        return None
    return np.frombuffer(raw, dtype="<u4").astype(np.uint32)


def of_chunks(x: np.ndarray, chunk: tuple[int, ...]) -> int:
    """The CHUNKS checksum of a whole in-memory array on the grid of `chunk`."""
    x = np.asarray(x)
    if x.size == 0:
        return 0
    return combine(
        chunk_part(x.shape, chunk, b, x[lazy.box_slices(b)]) for b in grid_boxes(x.shape, chunk)
    )


def to_hex(value: int) -> str:
    """16 lowercase hex digits, as recorded in `trainer_state["checksums"]`."""
    return f"{value:016x}"
