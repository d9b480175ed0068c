"""A transposing read of a stored tensor goes from the file straight into the staging rows of its
transposing copy (`StoredTensor._rows_into`, `element_copy.transposed_rows`): each byte is copied
once in user space (staging rows -> `out`), where it was read into a fresh buffer of the whole
slab, copied into the staging rows (`memmove`), then into `out`. Counted, not timed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hybridckpt import lazy
from hybridckpt.io.byte_source import ByteSource, count_reads, planning
from hybridckpt.lazy import element_copy

RNG = np.random.default_rng(42)


def stored(tmp_path, x: np.ndarray):
    """`x` written to a file as a checkpoint stores it (C order, no header), and the lazy tensor
    over it: (the file's path, the `StoredTensor`)."""
    path = str(tmp_path / "w.bin")
    x.tofile(path)
    return path, lazy.StoredTensor(ByteSource(path), 0, x.shape, x.dtype)


@pytest.fixture
def copied(monkeypatch):
    """Bytes every `np.copyto` writes (the user-space copies of a read), and the fresh slab
    buffers `ByteSource.read_span` makes."""
    tally = {"copy_bytes": 0, "spans": 0}
    real_copy, real_span = np.copyto, ByteSource.read_span

    def copyto(dst, src, *a, **k):
        tally["copy_bytes"] += np.asarray(dst).nbytes
        return real_copy(dst, src, *a, **k)

    def span(self, *a, **k):
        tally["spans"] += 1
        return real_span(self, *a, **k)

    monkeypatch.setattr(np, "copyto", copyto)
    monkeypatch.setattr(ByteSource, "read_span", span)
    return tally


@pytest.mark.parametrize(("box", "what"), [
    (((0, 160), (0, 2048)), "one run: whole rows side by side"),
    (((0, 300), (0, 1024)), "runs a page apart: half of each 8 KiB row"),
    (((7, 290), (1536, 2048)), "runs far apart: a quarter of each row, not from the start"),
])
def test_a_transposed_read_copies_each_byte_once_in_user_space(tmp_path, copied, box, what):
    x = RNG.standard_normal((300, 2048)).astype(np.float32)  # torch's [out, in] rows, 8 KiB each
    path, t = stored(tmp_path, x)
    shape = lazy.box_shape(box)
    tile = np.full(shape[::-1], np.nan, np.float32)  # the [in, out] tile a kernel is read into
    with count_reads() as c:
        t.read_into(box, tile.T)
    want = x[box[0][0]:box[0][1], box[1][0]:box[1][1]]
    assert tile.T.tobytes() == np.ascontiguousarray(want).tobytes(), what
    # one user-space copy of each byte (before: a second, the slab into the staging rows), no slab buffer
    assert copied == {"copy_bytes": tile.nbytes, "spans": 0}, what
    assert c[path] == tile.nbytes  # the runs' bytes, as before (gaps counted apart)


def test_the_staging_buffer_is_made_once_a_thread(tmp_path):
    """Tile after tile, the staging rows are the same buffer: no fresh pages a strip or a tile
    (before: a fresh slab buffer a tile, its pages zeroed by the kernel, and a stage a tile)."""
    x = RNG.standard_normal((256, 1024)).astype(np.float32)
    path, t = stored(tmp_path, x)
    tile = np.empty((512, 256), np.float32)
    t.read_into(((0, 256), (0, 512)), tile.T)
    made = element_copy.stage_allocations[0]
    for j in range(0, 1024, 512):
        for _ in range(3):
            t.read_into(((0, 256), (j, j + 512)), tile.T)
            assert np.array_equal(tile.T, x[:, j:j + 512])
    assert element_copy.stage_allocations[0] == made


@pytest.mark.parametrize(("src", "dst"), [(ml_dtypes.bfloat16, np.float32), (np.float32, ml_dtypes.bfloat16),
                                         (np.int8, np.int8), (np.float64, np.float64)])
def test_staged_reads_cast_and_walk_stacked_layers_exactly(tmp_path, monkeypatch, src, dst):
    """A cast, a stacked `[layers, out, in]` tensor (the other axes one 2-D slice at a time) and
    short strips (STRIP_ROWS 3: many strips, a last short one) give numpy's values; NaN payloads
    and -0.0 survive a same-dtype read bit for bit."""
    monkeypatch.setattr(element_copy, "STRIP_ROWS", 3)
    raw = RNG.bytes(3 * 11 * 700 * np.dtype(src).itemsize)
    x = np.frombuffer(raw, np.dtype(src)).reshape(3, 11, 700)  # NaNs of every payload where float
    path, t = stored(tmp_path, x)
    for box in (((0, 3), (0, 11), (0, 700)), ((1, 3), (2, 9), (100, 650))):
        with np.errstate(invalid="ignore"):
            want = x[tuple(slice(a, b) for a, b in box)].astype(dst)
        buf = np.empty(want.shape[::-1], dst)
        with np.errstate(invalid="ignore"):
            t.read_into(box, buf.T)  # the out's contiguous axis: the layers'
        assert buf.T.view(f"u{np.dtype(dst).itemsize}").tolist() == want.view(f"u{np.dtype(dst).itemsize}").tolist()
        swapped = np.empty((want.shape[0], want.shape[2], want.shape[1]), dst)
        with np.errstate(invalid="ignore"):
            t.read_into(box, swapped.transpose(0, 2, 1))  # per layer [in, out]
        assert swapped.transpose(0, 2, 1).view(f"u{np.dtype(dst).itemsize}").tolist() == \
            want.view(f"u{np.dtype(dst).itemsize}").tolist()


def test_a_planned_staged_read_counts_the_real_reads_and_writes_nothing(tmp_path):
    x = RNG.standard_normal((300, 2048)).astype(np.float32)
    path, t = stored(tmp_path, x)
    for box in (((0, 160), (0, 2048)), ((0, 300), (0, 1024))):
        tile = np.zeros(lazy.box_shape(box)[::-1], np.float32)
        with count_reads(this_thread=True) as dry, planning():
            t.read_into(box, tile.T)
        assert not tile.any()
        with count_reads(this_thread=True) as real:
            t.read_into(box, tile.T)
        assert dry == real and np.array_equal(tile.T, x[box[0][0]:box[0][1], box[1][0]:box[1][1]])


def test_a_file_shorter_than_its_rows_is_one_error_not_zeros(tmp_path):
    from hybridckpt.errors import FormatError

    x = RNG.standard_normal((300, 2048)).astype(np.float32)
    path = str(tmp_path / "w.bin")
    x[:200].tofile(path)  # the header says 300 rows; the file holds 200
    t = lazy.StoredTensor(ByteSource(path), 0, x.shape, x.dtype)
    for box in (((0, 300), (0, 2048)), ((0, 300), (0, 1024))):
        tile = np.empty(lazy.box_shape(box)[::-1], np.float32)
        with pytest.raises(FormatError, match="truncated"):
            t.read_into(box, tile.T)


def test_a_save_drops_the_staging_buffers_it_kept(tmp_path):
    """The staging rows a reader thread keeps between tiles are dropped when the save ends (as
    the save's tile buffers are): nothing of the import stays held in the reader threads."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from hybridckpt.store import save_checkpoint, stream

    x = RNG.standard_normal((256, 1024)).astype(np.float32)
    path, t = stored(tmp_path, x)
    tile = np.empty((1024, 256), np.float32)
    t.read_into(((0, 256), (0, 1024)), tile.T)
    assert element_copy.kept_stage_bytes() > 0  # this thread's, kept
    opts = stream.StreamOptions(tile_bytes=256 << 10, chunk_bytes=256 << 10)
    leaf = stream.LazyLeaf(lazy.Transpose(t, (1, 0)), SingleDeviceSharding(jax.devices()[0]), "w", (), opts)
    save_checkpoint(tmp_path / "ck", 1, {"w": leaf})
    assert opts.stats.bytes_written == x.nbytes and element_copy.kept_stage_bytes() == 0
