"""A restore's direct pieces read straight from their chunk files at the right bytes (issue 42).

`store.checked.CheckedArray._direct_piece` reads a piece that is one run of its chunk's C-order
bytes from the chunk file itself (`ChunkGrid.chunk_file`: file and offset), at the piece's start
in the chunk (`lazy.one_run`), instead of walking the chunk grid again for every piece. A zarr
chunk at the grid's edge is stored padded to the full chunk shape; a piece of one clipped on a
later axis is one run of the clipped box but not of the stored bytes, so it must be read through
the grid (`inner`), which knows the padding. The arrays here are built by hand: raw chunk files
written with numpy, padding filled with values that must never be read.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hybridckpt import checksum
from hybridckpt.containers.orbax.reader import ChunkGrid
from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.lazy import StoredTensor, box_runs, one_run
from hybridckpt.store import checked

pytestmark = pytest.mark.skipif(not checksum.has_crc32_combine(), reason="direct pieces need zlib-ng's crc32_combine")


class _Stored:
    """An array of our store as `CheckedArray` sees one: reads through the grid, `raw()` the grid."""

    def __init__(self, grid: ChunkGrid):
        self.grid, self.shape, self.dtype = grid, grid.shape, grid.dtype

    def raw(self):
        return self.grid

    def read_into(self, box, out):
        self.grid.read_into(box, out)

    def read_box(self, box):
        out = np.empty(tuple(b - a for a, b in box), self.dtype)
        self.grid.read_into(box, out)
        return out


def stored(tmp_path, value: np.ndarray, chunk: tuple[int, ...]) -> checked.CheckedArray:
    """`value` as raw chunk files of `chunk` (edge chunks padded with 1e30), wrapped as a restore
    wraps it: CRC-32s of the clipped chunks, direct pieces on, a scratch pool."""
    pieces, crcs = [], []
    steps = [range(0, n, c) for n, c in zip(value.shape, chunk, strict=True)]
    for origin in itertools.product(*steps):
        part = value[tuple(slice(o, o + c) for o, c in zip(origin, chunk, strict=True))]
        padded = np.full(chunk, 1e30, value.dtype)
        padded[tuple(slice(0, n) for n in part.shape)] = part
        path = tmp_path / ".".join(str(o // c) for o, c in zip(origin, chunk, strict=True))
        path.write_bytes(padded.tobytes())
        pieces.append((origin, StoredTensor(ByteSource(str(path)), 0, chunk, value.dtype)))
        crcs.append(checksum.crc32_of(part))
    grid = ChunkGrid(value.shape, value.dtype, tuple(pieces), chunk)
    out = checked.CheckedArray(_Stored(grid), chunk, np.array(crcs, np.uint32), "w", str(tmp_path))
    out.direct, out.scratch = True, AlignedPool(4 * checked.SCRATCH_PIECE_BYTES, unit=checked.SCRATCH_PIECE_BYTES)
    return out


def test_one_run_agrees_with_box_runs():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        shape = tuple(int(n) for n in rng.integers(1, 5, rng.integers(0, 5)))
        box = []
        for n in shape:
            a = int(rng.integers(0, n + 1))
            box.append((a, int(rng.integers(a, n + 1))))
        starts, run = box_runs(shape, tuple(box))
        want = int(starts[0]) if len(starts) == 1 and run else None
        assert one_run(shape, tuple(box)) == want, (shape, box)


@pytest.mark.parametrize("rows", [(0, 2), (2, 4), (1, 3)])
def test_pieces_of_whole_and_edge_chunks_are_read_at_their_bytes(tmp_path, rows, monkeypatch):
    value = np.random.default_rng(1).standard_normal((4, 384)).astype(np.float32)
    t = stored(tmp_path, value, (4, 256))  # chunk 1 holds columns 256:384, stored padded to 256
    direct = []
    real = checked.CheckedArray._direct_piece
    monkeypatch.setattr(checked.CheckedArray, "_direct_piece",
                        lambda self, *a: direct.append(a[0]) or real(self, *a))
    out = np.zeros((rows[1] - rows[0], 384), np.float32)  # a shard of whole rows: both pieces strided
    t.read_into((rows, (0, 384)), out)
    t.release()
    np.testing.assert_array_equal(out, value[rows[0]:rows[1]])
    assert sorted(set(direct)) == [0, 1]  # (both chunks' pieces went the direct way)


def test_the_stored_file_of_a_direct_piece_is_the_one_read(tmp_path):
    """The chunk file named by the grid is what a direct piece reads: a byte flipped there fails
    the chunk's CRC-32, at the piece that read it."""
    value = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    t = stored(tmp_path, value, (4, 256))
    path = tmp_path / "0.1"
    raw = bytearray(path.read_bytes())
    raw[3 * 1024 + 5] ^= 0x10  # (row 3 of chunk 1)
    path.write_bytes(bytes(raw))
    out = np.zeros((2, 512), np.float32)
    t.read_into(((0, 2), (0, 512)), out)  # rows 0:2 do not hold the flipped byte
    with pytest.raises(checked.CheckpointError, match=r"chunk 0\.1 .* has CRC-32"):
        t.read_into(((2, 4), (0, 512)), np.zeros((2, 512), np.float32))
