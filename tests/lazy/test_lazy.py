"""Lazy views equal their numpy reference for random compositions and boxes, and read only their box."""

import ml_dtypes
import numpy as np
import pytest
from fixtures.lazy_views import SETTINGS, boxes, composed, shapes, stored_in_blob
from hypothesis import given
from hypothesis import strategies as st

from hybridckpt import lazy
from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import ByteSource, count_reads


@SETTINGS
@given(data=st.data())
def test_random_compositions_and_boxes_equal_numpy(blob, data):
    t, ref = data.draw(composed(blob))
    assert t.shape == ref.shape
    box = data.draw(boxes(t.shape))
    got = t.read_box(box)
    want = ref[tuple(slice(a, b) for a, b in box)]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    # flat reads too
    a = data.draw(st.integers(0, t.size))
    b = data.draw(st.integers(a, t.size))
    np.testing.assert_array_equal(t.read_flat(a, b), ref.reshape(-1)[a:b])


@SETTINGS
@given(data=st.data())
def test_stored_box_reads_exactly_its_bytes(blob, data):
    shape = data.draw(shapes)
    t, ref = stored_in_blob(blob, shape)
    box = data.draw(boxes(shape))
    with count_reads() as c:
        got = t.read_box(box)
    np.testing.assert_array_equal(got, ref[tuple(slice(a, b) for a, b in box)])
    assert c[blob] == got.nbytes


def test_concat_reads_only_the_parts_a_box_touches(tmp_path):
    paths = []
    for r in range(4):  # four "tensor-parallel ranks", 8 rows each
        p = tmp_path / f"rank{r}.bin"
        np.full((8, 16), r, dtype=np.float32).tofile(p)
        paths.append(str(p))
    parts = [lazy.StoredTensor(ByteSource(p), 0, (8, 16), np.dtype(np.float32)) for p in paths]
    t = lazy.Concat(tuple(parts), 0)
    with count_reads() as c:
        got = t.read_box(((10, 14), (0, 16)))  # rows 10..13 live in rank 1 only
    assert (got == 1).all()
    assert c[paths[1]] == got.nbytes
    assert c[paths[0]] == c[paths[2]] == c[paths[3]] == 0


def test_transposed_tp_shard_box_reads_only_its_box(tmp_path):
    """A column block of a transposed [out, in] weight (a kernel's tp shard) reads only those rows."""
    p = tmp_path / "w.bin"
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    w.tofile(p)
    kernel = lazy.transpose(lazy.StoredTensor(ByteSource(str(p)), 0, (64, 32), np.dtype(np.float32)))
    with count_reads() as c:
        got = kernel.read_box(((0, 32), (16, 32)))
    np.testing.assert_array_equal(got, w.T[:, 16:32])
    assert c[str(p)] == got.nbytes


def test_reshape_of_flat_ranges_split_across_ranks(tmp_path):
    """ZeRO-style: a flat buffer split in 3 equal partitions; a param is a range of it, reshaped."""
    flat = np.arange(100, dtype=np.float32) * 0.5
    parts = []
    for r, chunk in enumerate(np.array_split(flat, 3)):
        p = tmp_path / f"part{r}.bin"
        chunk.tofile(p)
        parts.append(lazy.StoredTensor(ByteSource(str(p)), 0, chunk.shape, chunk.dtype))
    buf = lazy.Concat(tuple(parts), 0)
    param = lazy.reshape(lazy.slice_axis(buf, 0, 10, 10 + 48), (6, 8))
    np.testing.assert_array_equal(param.materialize(), flat[10:58].reshape(6, 8))
    np.testing.assert_array_equal(param.read_box(((2, 5), (3, 7))), flat[10:58].reshape(6, 8)[2:5, 3:7])


def test_stored_strided_matches_torch_like_views(tmp_path):
    p = tmp_path / "s.bin"
    storage = np.arange(300, dtype=np.float32)
    storage.tofile(p)
    src = ByteSource(str(p))
    base = storage[20:140].reshape(6, 20)
    cases = [
        (base.shape, (20, 1), 20, base),
        ((20, 6), (1, 20), 20, base.T),
        ((4, 5), (20, 1), 20 + 2 * 20 + 3, base[2:6, 3:8]),
        ((3, 4), (0, 1), 7, np.broadcast_to(storage[7:11], (3, 4))),
        ((3, 3), (40, 2), 5, storage[5:].reshape(-1)[: 3 * 40].reshape(3, 40)[:, :6:2]),
    ]
    for shape, strides, off, want in cases:
        t = lazy.stored_strided(src, 0, 300, np.float32, shape, strides, off)
        np.testing.assert_array_equal(t.materialize(), want)
    with pytest.raises(FormatError, match="reaches element"):
        lazy.stored_strided(src, 0, 300, np.float32, (10, 40), (40, 1), 0, what="x.pt:weight")


def test_bf16_cast_is_exact_upcast(tmp_path):
    vals = np.array([1.5, -2.25, 3.0e-3, 65504.0], dtype=np.float32).astype(ml_dtypes.bfloat16)
    p = tmp_path / "b.bin"
    vals.tofile(p)
    t = lazy.Cast(lazy.StoredTensor(ByteSource(str(p)), 0, (4,), vals.dtype), np.dtype(np.float32))
    np.testing.assert_array_equal(t.materialize(), vals.astype(np.float32))


def test_truncated_file_is_a_format_error(tmp_path):
    p = tmp_path / "short.bin"
    np.zeros(4, dtype=np.float32).tofile(p)
    t = lazy.StoredTensor(ByteSource(str(p)), 0, (8,), np.dtype(np.float32))
    with pytest.raises(FormatError, match="short.bin: truncated"):
        t.materialize()


def test_concat_and_stack_refuse_mismatched_parts():
    a = lazy.ArrayTensor(np.zeros((2, 3), np.float32))
    b = lazy.ArrayTensor(np.zeros((2, 4), np.float32))
    with pytest.raises(FormatError, match="cannot concatenate"):
        lazy.Concat((a, b), 0)
    with pytest.raises(FormatError, match="cannot stack"):
        lazy.Stack((a, b))


def test_bitcast_views_bytes_without_changing_them():
    vals = np.array([[1.5, -2.25], [3.0e-3, 65504.0]], dtype=np.float32).astype(ml_dtypes.bfloat16)
    bits = lazy.Bitcast(lazy.ArrayTensor(vals), np.dtype(np.uint16))
    np.testing.assert_array_equal(bits.read_box(((1, 2), (0, 2))), vals.view(np.uint16)[1:2])
    back = lazy.Bitcast(bits, np.dtype(ml_dtypes.bfloat16)).materialize()
    np.testing.assert_array_equal(back.view(np.uint16), vals.view(np.uint16))
    with pytest.raises(FormatError, match="item sizes differ"):
        lazy.Bitcast(lazy.ArrayTensor(vals), np.dtype(np.float32))


def test_a_box_of_many_runs_is_one_read_and_one_copy(tmp_path):
    """A tp shard of a row-parallel weight (half of every row) is thousands of runs: its span is
    read with one pread and copied out in one call (transposed or cast on the way), counted as
    the box's bytes (the gaps apart); a box that is one run is one pread. Equal to numpy."""
    p = str(tmp_path / "w.bin")
    w = np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024)  # rows of 4 KiB
    w.tofile(p)
    t = lazy.StoredTensor(ByteSource(p), 0, w.shape, np.dtype(np.float32))
    with count_reads() as c:
        got = t.read_box(((0, 256), (0, 512)))  # 2 KiB runs, 2 KiB gaps
    np.testing.assert_array_equal(got, w[:, :512])
    assert c[p] == got.nbytes and c[(p, "calls")] == 1 and c[(p, "gap")] == 255 * 2048
    with count_reads() as c:
        got = t.read_box(((0, 256), (0, 8)))  # 32-byte runs a row apart: within a page
    np.testing.assert_array_equal(got, w[:, :8])
    assert c[p] == got.nbytes and c[(p, "calls")] == 1
    out = np.empty((512, 200), np.float64)  # transposed and cast straight out of the span
    t.read_into(((50, 250), (100, 612)), out.T)
    np.testing.assert_array_equal(out.T, w[50:250, 100:612].astype(np.float64))
    with count_reads() as c:
        got = t.read_box(((3, 9), (0, 1024)))  # whole rows: one run, one pread
    np.testing.assert_array_equal(got, w[3:9])
    assert c[p] == got.nbytes and c[(p, "calls")] == 1 and c[(p, "gap")] == 0


def test_runs_far_apart_are_a_pread_each_and_spans_go_in_slabs(tmp_path, monkeypatch):
    """Runs a page or more apart are read one pread each (no gap bytes); a
    box whose span is over SPAN_BYTES is read slab by slab (so a read's buffer stays bounded).
    Same values either way."""
    from hybridckpt.lazy import stored

    p = str(tmp_path / "w.bin")
    w = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)  # rows of 16 KiB
    w.tofile(p)
    t = lazy.StoredTensor(ByteSource(p), 0, w.shape, np.dtype(np.float32))
    with count_reads() as c:
        got = t.read_box(((0, 64), (0, 16)))  # 64-byte runs 16 KiB apart
    np.testing.assert_array_equal(got, w[:, :16])
    assert c[p] == got.nbytes and c[(p, "calls")] == 64 and c[(p, "gap")] == 0
    v = np.arange(6 * 40 * 30, dtype=np.int16).reshape(6, 40, 30)
    q = str(tmp_path / "v.bin")
    v.tofile(q)
    t = lazy.StoredTensor(ByteSource(q), 0, v.shape, np.dtype(np.int16))
    box = ((1, 6), (3, 37), (2, 29))
    spans = []
    real = ByteSource.read_span

    def spy(self, offset, nbytes, run_starts, run_bytes):
        spans.append(nbytes)
        return real(self, offset, nbytes, run_starts, run_bytes)

    monkeypatch.setattr(ByteSource, "read_span", spy)
    for limit in (10**9, 40 * 30 * 2, 30 * 2 * 5, 2):  # one span; a slab a layer; rows; elements
        monkeypatch.setattr(stored, "SPAN_BYTES", limit)
        spans.clear()
        got = np.empty((27, 34, 5), np.int16)
        t.read_into(box, got.transpose(2, 1, 0))
        np.testing.assert_array_equal(got.transpose(2, 1, 0), v[1:6, 3:37, 2:29])
        assert max(spans) <= max(limit, 2), (limit, max(spans))
    assert len(spans) == 5 * 34 * 27  # the smallest limit: one element a read


def test_a_file_truncated_while_it_is_read_is_one_error(tmp_path, monkeypatch):
    """Another process cutting the file between the size check and the read: the read sees the
    end (a FormatError saying "truncated"), never a SIGBUS (nothing is mapped)."""
    import os

    from hybridckpt.lazy import stored

    p = str(tmp_path / "w.bin")
    np.zeros((64, 256), np.float32).tofile(p)
    t = lazy.StoredTensor(ByteSource(p), 0, (64, 256), np.dtype(np.float32))
    real = ByteSource.read_span

    def cut_first(self, offset, nbytes, run_starts, run_bytes):
        os.truncate(p, 1000)
        return real(self, offset, nbytes, run_starts, run_bytes)

    monkeypatch.setattr(ByteSource, "read_span", cut_first)
    monkeypatch.setattr(stored, "SPAN_BYTES", 1 << 30)
    with pytest.raises(FormatError, match="truncated"):
        t.read_box(((0, 64), (0, 128)))


def test_a_truncated_file_under_a_many_run_read_is_one_error(tmp_path):
    p = str(tmp_path / "w.bin")
    np.zeros((64, 256), np.float32).tofile(p)
    __import__("os").truncate(p, 64 * 256 * 4 - 800)  # the last run cut short
    t = lazy.StoredTensor(ByteSource(p), 0, (64, 256), np.dtype(np.float32))
    with pytest.raises(FormatError, match="truncated"):
        t.read_box(((0, 64), (0, 128)))


def test_runs_far_apart_truncated_or_planned(tmp_path, monkeypatch):
    """The pread-a-run path (`ByteSource.read_runs`): a file cut short inside the last of many
    runs far apart is one FormatError naming the truncation; a negative offset (a corrupt header)
    is one FormatError, not an EINVAL; under `planning` nothing is read (the buffer keeps its
    bytes) and the runs are counted as the real read counts them, in one step."""
    import os

    from hybridckpt.io.byte_source import planning

    p = str(tmp_path / "w.bin")
    w = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)
    w.tofile(p)
    t = lazy.StoredTensor(ByteSource(p), 0, w.shape, np.dtype(np.float32))
    box = ((0, 64), (4000, 4096))  # 64 runs of 384 B, 16 KiB apart
    with count_reads() as real:
        np.testing.assert_array_equal(t.read_box(box), w[:, 4000:])
    out = np.full((64, 96), -1.0, np.float32)
    calls = []
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(a) or 0)
    with count_reads() as everyone, count_reads(this_thread=True) as dry, planning():
        t.read_into(box, out)
    monkeypatch.undo()
    assert calls == [] and (out == -1.0).all() and not everyone  # planned reads are this thread's counters' alone
    assert dry == real and real[(p, "calls")] == 64 and real[p] == 64 * 96 * 4
    with pytest.raises(FormatError, match="before the start of the file"):
        ByteSource(p).read_runs(np.array([0, -4096]), 16, memoryview(bytearray(32)))
    os.truncate(p, w.nbytes - 100)  # the last run cut short
    from hybridckpt.io.byte_source import close_all

    close_all()
    with pytest.raises(FormatError, match="truncated"):
        t.read_box(box)


def test_a_reshaped_flat_range_is_read_as_a_stored_tensor(tmp_path, monkeypatch):
    """A parameter inside a flat 1-D buffer (a Megatron optimizer bucket, a ZeRO flat), reshaped:
    a box of many rows is read as a stored tensor's box (rows a page or more apart: one call
    for all, batched preadvs; closer rows: one span), never a `read_flat` a row; equal values. A
    flat range split over two files (a bucket cut between DP ranks) is read row by row, as
    before, with the same values."""
    from hybridckpt.lazy import views

    p = str(tmp_path / "bucket.bin")
    flat = np.arange(100 + 32 * 2048, dtype=np.float32)
    flat.tofile(p)
    bucket = lazy.StoredTensor(ByteSource(p), 0, flat.shape, np.dtype(np.float32))
    param = lazy.reshape(lazy.slice_axis(bucket, 0, 100, 100 + 32 * 2048), (32, 2048))
    want = flat[100:].reshape(32, 2048)
    rows = []
    real = views.Reshape._runs_into
    monkeypatch.setattr(views.Reshape, "_runs_into", lambda self, box, out: rows.append(box) or real(self, box, out))
    # rows of 64 B 8 KiB apart: one preadv of them all (gaps under GAP_PER_CALL_BYTES); rows 592 B
    # apart: one span; one run: one read
    for box, calls in ((((0, 32), (8, 24)), 1), (((3, 30), (0, 1900)), 1), (((5, 6), (7, 9)), 1)):
        with count_reads() as c:
            got = param.read_box(box)
        np.testing.assert_array_equal(got, want[tuple(slice(a, b) for a, b in box)])
        assert c[(p, "calls")] == calls and c[p] == got.nbytes, box
    assert rows == []  # one run too: one read straight into `out` (no read_flat, no copy: test_bucket_param_reads)
    q = str(tmp_path / "other.bin")
    flat[100 + 16 * 2048:].tofile(q)
    split = lazy.reshape(lazy.concat([lazy.slice_axis(bucket, 0, 100, 100 + 16 * 2048),
                                      lazy.StoredTensor(ByteSource(q), 0, (16 * 2048,), np.dtype(np.float32))], 0),
                         (32, 2048))
    rows.clear()
    np.testing.assert_array_equal(split.read_box(((0, 32), (8, 24))), want[:, 8:24])
    assert rows == [((0, 32), (8, 24))]


def test_a_deferred_chunk_found_for_its_file_runs_is_parsed_by_real_reads(tmp_path):
    """Under a read plan (`planning`), a chunk asked for its file runs before any read (a
    reshape's stored span) parses its archive by real reads, as for a read: not the planned
    reads' untouched buffer (which is no archive)."""
    import torch

    from hybridckpt.formats.dcp.chunk import TorchSaveChunk
    from hybridckpt.io.byte_source import planning

    p = str(tmp_path / "c.pt")
    torch.save(torch.arange(64, dtype=torch.float32), p)
    size = __import__("os").path.getsize(p)
    chunk = TorchSaveChunk(p, 0, size, (64,), np.dtype(np.float32))
    with planning():
        runs = chunk.file_runs(((0, 64),), 1)
    assert len(runs) == 1 and runs[0].nbytes == 256


def test_one_run_into_a_strided_buffer_is_read_into_its_rows(tmp_path, monkeypatch):
    """A box that is one run of the file, read into a buffer whose rows are strided (a piece of a
    chunk into its place in a shard), is preadv'd straight into those rows (`read_scatter`):
    before, it was read into a span buffer (`read_span`) and copied. A file cut short is still a
    FormatError naming it."""
    data = np.arange(8 * 300, dtype=np.float32).reshape(8, 300)
    path = tmp_path / "chunk"
    path.write_bytes(b"\0" * 16 + data.tobytes())
    t = lazy.StoredTensor(ByteSource(str(path)), 16, (8, 300), np.dtype(np.float32))
    monkeypatch.setattr(ByteSource, "read_span", lambda *a: pytest.fail("read into a span buffer and copied"))
    shard = np.zeros((4, 600), dtype=np.float32)
    with count_reads() as counter:
        t.read_into(((2, 6), (0, 300)), shard[:, 300:])
    assert shard[:, 300:].tobytes() == data[2:6].tobytes() and not shard[:, :300].any()
    assert counter[(str(path), "calls")] == 1 and counter[str(path)] == data[2:6].nbytes
    path.write_bytes(b"\0" * 16 + data[:5].tobytes())
    with pytest.raises(FormatError, match=r"chunk.* (truncated|changed while it was read)"):
        t.read_into(((2, 6), (0, 300)), shard[:, 300:])
