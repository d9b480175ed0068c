"""Tiles grow where the source's reads are short (`store.stream.box_tiles`).

A target cutting a tensor across the rows its source stored whole (the transpose of a row-major
`[out, in]` file, as fsdp on a JAX kernel's `in` dim reads an FSDP2 chunk) reads a strip of every
source row per tile; a tile of more chunks along the cut makes each strip longer. Shown on a
stored `[64, 8192]` fp32 file read as its transpose: 8 KiB tiles read 128 B strips, grown tiles
read 2 KiB strips in 16x fewer preads, the saved arrays bit for bit the same, the tiles bounded
by half the in-flight budget; a source read in long runs keeps its tiles.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hybridckpt import lazy
from hybridckpt.io.byte_source import ByteSource, count_reads
from hybridckpt.store import CheckpointStore, save_checkpoint, stream

ROWS, COLS = 64, 8192  # the file: [ROWS, COLS] fp32, rows of 32 KiB


def _stored(tmp_path) -> tuple[lazy.LazyTensor, np.ndarray, str]:
    w = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    p = str(tmp_path / "w.bin")
    w.tofile(p)
    return lazy.StoredTensor(ByteSource(p), 0, w.shape, np.dtype(np.float32)), w, p


def _leaf(tensor, opts) -> stream.LazyLeaf:
    return stream.LazyLeaf(tensor, SingleDeviceSharding(jax.devices()[0]), "w", (), opts)


def test_short_reads_grow_the_tile_long_reads_do_not(tmp_path):
    t, _, _ = _stored(tmp_path)
    leaf = _leaf(lazy.Transpose(t, (1, 0)), None)  # [COLS, ROWS]: a tile of target rows is a strip of every source row
    box = ((0, COLS), (0, ROWS))
    chunk = (32, ROWS)  # 8 KiB chunks
    small = list(stream.plan_tiles(box, chunk, 4, 8 << 10))
    grown = stream.box_tiles(leaf, box, chunk, 8 << 10, inflight_bytes=256 << 10)
    assert len(small) == COLS // 32 and len(grown) == COLS // 512  # 128 KiB tiles: half the budget
    assert stream._mean_read_bytes(leaf, small[0]) == 128 and stream._mean_read_bytes(leaf, grown[0]) == 2048
    # the tiles still cover the box with whole chunks, in order
    assert grown[0] == ((0, 512), (0, ROWS)) and grown[-1] == ((COLS - 512, COLS), (0, ROWS))
    # no room to grow (half the in-flight budget is one tile): the tiles stay
    assert stream.box_tiles(leaf, box, chunk, 8 << 10, inflight_bytes=16 << 10) == small
    # the source read in whole rows: runs of 8 KiB, nothing to gain
    direct = _leaf(t, None)
    rows = list(stream.plan_tiles(((0, ROWS), (0, COLS)), (1, COLS), 4, 64 << 10))
    assert stream.box_tiles(direct, ((0, ROWS), (0, COLS)), (1, COLS), 64 << 10, 1 << 30) == rows


def test_a_grown_save_reads_fewer_times_and_stores_the_same_bytes(tmp_path):
    t, w, p = _stored(tmp_path)
    got, calls = {}, {}
    for name, inflight in (("kept", 16 << 10), ("grown", 256 << 10)):
        opts = stream.StreamOptions(tile_bytes=8 << 10, chunk_bytes=8 << 10, inflight_bytes=inflight)
        with count_reads() as c:
            save_checkpoint(tmp_path / name, 1, {"w": _leaf(lazy.Transpose(t, (1, 0)), opts)})
        calls[name] = c[(p, "calls")]
        assert opts.stats.largest_tile_bytes == (8 << 10 if name == "kept" else 128 << 10)
        with CheckpointStore(tmp_path / name) as store:
            target = {"w": jax.ShapeDtypeStruct((COLS, ROWS), np.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
            got[name] = np.asarray(store.restore(1, target_params=target).params["w"])
    assert calls == {"kept": COLS // 32 * ROWS, "grown": COLS // 512 * ROWS}  # a pread a strip
    assert np.array_equal(got["kept"], w.T) and np.array_equal(got["grown"], w.T)
