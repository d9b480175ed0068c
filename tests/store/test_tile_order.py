"""A transposed source's tiles are cut along the kernel's last axis (`store.stream.leaf_tiling`).

A torch `[out, in]` weight (HF safetensors, a DCP or Megatron shard) imported as a JAX `[in,
out]` kernel whose chunks cut both axes: tiles cut along `in` (the leading axes first, as
before) read a strip of every file row, the gaps between strips read too (a `preadv` a strip,
the gaps into scratch) and each chunk copied out of the tile, a strip of it; tiles cut along
`out`, grown until they hold whole file rows, read each strip of rows in one run, skip nothing,
and their chunks are whole rows of the tile, written with no copy. Shown on a stored `[256,
2048]` fp32 file (8 KiB rows) read as its transpose in 64 KiB chunks: the reads, the gap bytes
and the chunk copies counted, the saved array bit for bit the transpose. A row-major source (the
same file read as it is) keeps the leading-axes tiles, whole rows already.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hybridckpt import lazy
from hybridckpt.containers.orbax import chunk_files
from hybridckpt.io.byte_source import ByteSource, count_reads
from hybridckpt.store import CheckpointStore, save_checkpoint, stream

OUT, IN = 256, 2048  # the file: [OUT, IN] fp32, rows of 8 KiB
OPTS = {"tile_bytes": 512 << 10, "chunk_bytes": 64 << 10, "inflight_bytes": 2 << 20}  # tiles grow to 1 MiB


def _stored(tmp_path) -> tuple[lazy.StoredTensor, np.ndarray, str]:
    w = np.random.default_rng(1).standard_normal((OUT, IN)).astype(np.float32)
    p = str(tmp_path / "w.bin")
    w.tofile(p)
    return lazy.StoredTensor(ByteSource(p), 0, w.shape, np.dtype(np.float32)), w, p


def _leaf(tensor) -> stream.LazyLeaf:
    return stream.LazyLeaf(tensor, SingleDeviceSharding(jax.devices()[0]), "w", (), stream.StreamOptions(**OPTS))


def _save(tmp_path, leaf, monkeypatch) -> tuple[dict, int, np.ndarray]:
    """Save `leaf` (its reads counted, and the chunks copied out of their tile) and restore it."""
    copies = []
    real = chunk_files._chunk_bytes

    def counted(piece, chunk, spare=None):
        out = real(piece, chunk, spare)
        copies.append(out is not piece)
        return out

    monkeypatch.setattr(chunk_files, "_chunk_bytes", counted)
    with count_reads() as c:
        save_checkpoint(tmp_path / "ck", 1, {"w": leaf})
    with CheckpointStore(tmp_path / "ck") as store:
        target = {"w": jax.ShapeDtypeStruct(leaf.shape, np.float32, sharding=leaf.sharding)}
        got = np.asarray(store.restore(1, target_params=target).params["w"])
    return c, sum(copies), got


def test_a_transposed_source_is_read_in_whole_rows_and_written_without_copies(tmp_path, monkeypatch):
    t, w, p = _stored(tmp_path)
    leaf = _leaf(lazy.Transpose(t, (1, 0)))  # [IN, OUT]
    chunk = stream.chunk_shape(leaf)
    assert chunk == (128, 128)  # the premise: 64 KiB chunks cut both axes
    box = ((0, IN), (0, OUT))
    # before: the leading axes first, [1024, 256] tiles (grown from 512 KiB while reads were
    # under 4 KiB): a 4 KiB half of every file row, 4 KiB gaps between
    assert stream.leaf_tiling(leaf, chunk, OPTS["tile_bytes"], OPTS["inflight_bytes"]) == stream.Tiling(1 << 20, (1, 0))
    assert stream.box_tiles(leaf, box, chunk, OPTS["tile_bytes"], OPTS["inflight_bytes"]) == [
        ((0, IN), (0, 128)), ((0, IN), (128, OUT))]  # whole file rows: 128 of them a tile
    c, copies, got = _save(tmp_path, leaf, monkeypatch)
    assert c[p] == w.nbytes and c[(p, "gap")] == 0  # every byte once, no gap read (before: 2 MiB of gaps)
    assert c[(p, "calls")] == 2  # one preadv of 128 whole rows a tile (before: 4, of 128 runs each)
    assert copies == 0  # every chunk whole rows of its tile (before: all 32 copied out)
    assert np.array_equal(got, w.T)


def test_a_row_major_source_keeps_the_leading_axes_tiles(tmp_path, monkeypatch):
    t, w, p = _stored(tmp_path)
    leaf = _leaf(lazy.reshape(t, (IN, OUT)))  # the same bytes read in their own order
    chunk = stream.chunk_shape(leaf)
    box = ((0, IN), (0, OUT))
    tiles = stream.box_tiles(leaf, box, chunk, OPTS["tile_bytes"], OPTS["inflight_bytes"])
    assert tiles == list(stream.plan_tiles(box, chunk, 4, OPTS["tile_bytes"]))  # the other order reads 512 B runs
    c, _, got = _save(tmp_path, leaf, monkeypatch)
    assert c[p] == w.nbytes and c[(p, "gap")] == 0 and c[(p, "calls")] == len(tiles) == 4
    assert np.array_equal(got, w.reshape(IN, OUT))
