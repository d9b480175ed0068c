"""A reshaped flat range whose span crosses files (a Megatron torch_dist optimizer bucket cut
between DP ranks' files) is read per file, not per row: the calls a box costs do not grow with
its rows; the values are the bytes' own."""

import numpy as np
import pytest

from hybridckpt import lazy
from hybridckpt.io.byte_source import ByteSource, count_reads, planning
from hybridckpt.lazy import views


def rank_files(tmp_path, flat, cuts):
    """`flat` saved as one file per piece between `cuts` (a DP rank's shard each): the pieces as
    stored tensors, and their paths (also `test_bucket_param_reads.py`'s buckets)."""
    parts, paths = [], []
    for r, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        p = str(tmp_path / f"rank{r}.bin")
        flat[a:b].tofile(p)
        parts.append(lazy.StoredTensor(ByteSource(p), 0, (b - a,), flat.dtype))
        paths.append(p)
    return parts, paths


def _bucket(tmp_path, flat, cuts):
    """`flat` saved as one file per piece between `cuts`, joined."""
    parts, paths = rank_files(tmp_path, flat, cuts)
    return lazy.concat(parts, 0), paths


@pytest.mark.parametrize("rows", [64, 1024])
def test_a_box_across_files_costs_calls_per_file_not_per_row(tmp_path, monkeypatch, rows):
    """`rows` rows of 24 columns of a [rows, 96] parameter in a bucket cut across 3 files, rows
    crossing the cuts: at most 2 read calls per file (one `read_runs` for its whole rows, one
    piece of the row on its edge), the same for 64 rows and 1024, no `read_flat` through the
    views, equal to numpy bit for bit; a planned read counts the same."""
    cols, off = 96, 37
    flat = np.random.default_rng(rows).standard_normal(off + rows * cols + 50).astype(np.float32)
    n = rows * cols
    cuts = [0, off + n // 3 + 5, off + 2 * n // 3 + 11, flat.size]
    bucket, paths = _bucket(tmp_path, flat, cuts)
    param = lazy.reshape(lazy.slice_axis(bucket, 0, off, off + n), (rows, cols))
    want = flat[off : off + n].reshape(rows, cols)
    flats = []
    real = lazy.LazyTensor.read_flat
    monkeypatch.setattr(lazy.LazyTensor, "read_flat", lambda self, a, b: flats.append(a) or real(self, a, b))
    box = ((0, rows), (40, 64))
    with count_reads() as c:
        got = param.read_box(box)
    assert got.tobytes() == np.ascontiguousarray(want[:, 40:64]).tobytes()
    assert flats == []
    calls = {p: c[(p, "calls")] for p in paths}
    assert all(1 <= k <= 2 for k in calls.values()), calls
    assert sum(c[p] for p in paths) == got.nbytes
    with count_reads(this_thread=True) as dry, planning():
        param.read_box(box)
    assert {p: dry[(p, "calls")] for p in paths} == calls


def test_rows_crossing_several_files_and_whole_rows_equal_numpy(tmp_path):
    """Rows longer than a file's piece (a row across 3 files), whole-row boxes (one run a row
    block), single rows and single columns, a transposed `out`: every box equals numpy."""
    flat = np.arange(7 + 12 * 40 + 3, dtype=np.float32) * 0.25
    bucket, _ = _bucket(tmp_path, flat, [0, 30, 45, 61, 200, 333, flat.size])
    param = lazy.reshape(lazy.slice_axis(bucket, 0, 7, 7 + 480), (12, 40))
    want = flat[7:487].reshape(12, 40)
    for box in [((0, 12), (0, 40)), ((1, 11), (3, 39)), ((0, 12), (5, 6)), ((4, 5), (0, 40)),
                ((2, 9), (0, 40)), ((0, 12), (30, 40))]:
        got = param.read_box(box)
        assert got.tobytes() == np.ascontiguousarray(want[tuple(slice(a, b) for a, b in box)]).tobytes(), box
    np.testing.assert_array_equal(lazy.transpose(param).read_box(((0, 40), (0, 12))), want.T)


def test_a_span_with_a_computed_piece_keeps_the_row_path(tmp_path, monkeypatch):
    """A source piece that is no file's bytes (an in-memory array) has no file runs: the rows are
    read through the views, as before, with the same values."""
    flat = np.arange(200, dtype=np.float32)
    p = str(tmp_path / "a.bin")
    flat[:100].tofile(p)
    bucket = lazy.concat([lazy.StoredTensor(ByteSource(p), 0, (100,), flat.dtype), lazy.ArrayTensor(flat[100:])], 0)
    param = lazy.reshape(lazy.slice_axis(bucket, 0, 10, 190), (18, 10))
    used = []
    real = views.Reshape._runs_into
    monkeypatch.setattr(views.Reshape, "_runs_into", lambda self, b, o: used.append(b) or real(self, b, o))
    np.testing.assert_array_equal(param.read_box(((0, 18), (2, 5))), flat[10:190].reshape(18, 10)[:, 2:5])
    assert used == [((0, 18), (2, 5))]


def test_run_batches_cuts_long_batches_with_array_arithmetic(monkeypatch):
    """Many batches (runs far apart: an fsdp strip of every row) some longer than `IOV_MAX // 2`
    runs: the batch starts are the definition's (each batch cut every `per` runs), made by one
    `np.arange`, not one a batch (Python a batch was most of the plan's time after the rows)."""
    from hybridckpt.io import read_batches

    per = read_batches.IOV_MAX // 2
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 3 * per, 400)
    offs, pos, want = [], 0, []
    for n in lens.tolist():  # a batch of n runs of 64 B 1 KiB apart, then a 1 MiB gap
        want.extend(range(len(offs), len(offs) + n, per))
        offs.extend(pos + 1024 * np.arange(n))
        pos = offs[-1] + (1 << 20)
    offsets = np.array(offs, dtype=np.int64)
    calls = []
    real = np.arange
    monkeypatch.setattr(np, "arange", lambda *a, **k: calls.append(a) or real(*a, **k))
    starts, gap = read_batches.run_batches(offsets, 64)
    monkeypatch.undo()
    assert starts.tolist() == want and len(calls) <= 1
    first = set(want)
    inside = [i for i in range(1, len(offs)) if i not in first]
    assert gap == sum(int(offsets[i] - offsets[i - 1]) - 64 for i in inside)


def test_runs_far_apart_go_straight_into_a_contiguous_out(tmp_path, monkeypatch):
    """A box whose runs lie a page or more apart (the strips of rows that an fsdp cut of the
    source's rows gives a joined tile: half of each 8 KiB row) is read by `read_runs` straight
    into a C-contiguous `out` of the stored dtype: no packed buffer copied into it (before: one
    copy a slab); a cast `out` still gets its one copy (a transposed one is read into the
    staging rows of its transposing copy). Equal to numpy."""
    from hybridckpt.lazy import stored

    x = np.random.default_rng(3).standard_normal((64, 2048)).astype(np.float32)
    path = str(tmp_path / "rows.bin")
    x.tofile(path)
    t = lazy.StoredTensor(ByteSource(path), 0, x.shape, x.dtype)
    copies = []
    real = stored.copy_into
    monkeypatch.setattr(stored, "copy_into", lambda out, src: copies.append(out.shape) or real(out, src))
    box = ((0, 64), (0, 1024))  # 4 KiB runs, 4 KiB apart
    out = np.empty((64, 1024), np.float32)
    with count_reads() as c:
        t.read_into(box, out)
    assert out.tobytes() == np.ascontiguousarray(x[:, :1024]).tobytes()
    assert copies == [] and c[path] == out.nbytes
    tr = np.empty((1024, 64), np.float32)
    t.read_into(box, tr.T)  # transposed: straight into the staging rows (tests/lazy/test_staged_reads.py)
    assert tr.tobytes() == np.ascontiguousarray(x[:, :1024].T).tobytes() and copies == []
    cast = np.empty((64, 1024), np.float64)
    t.read_into(box, cast)
    assert np.array_equal(cast, x[:, :1024].astype(np.float64)) and copies == [(64, 1024)]
