"""A box of a parameter in a flat bucket that is one run of the bucket (a whole parameter of a
Megatron `dp_reshardable` optimizer bucket, or whole rows of it: the tiles of a torch_dist
import's moments) is read straight into the caller's buffer: into a C-order `out` by one pread,
into a transposed `out` (the `[in, out]` tile of an `[out, in]` parameter) strip by strip into
the staging rows of its transposing copy (`lazy.element_copy.transposed_rows`); before, it went
through `read_flat` (a fresh array), a copy into a second fresh array, and (transposed) one more
copy. A run that crosses the cut between two DP ranks' files: one read per file piece, straight
into `out`. Counted (reads, `read_flat` calls, element copies), the values numpy's."""

from __future__ import annotations

import numpy as np
import pytest
from test_span_runs import rank_files  # noqa: I001 - tests/lazy is on the path (pytest's import)

from hybridckpt import lazy
from hybridckpt.io.byte_source import count_reads
from hybridckpt.lazy import element_copy, stored, views

ROWS, COLS, OFF = 256, 384, 40  # the parameter [ROWS, COLS] fp32 at element OFF of the bucket


def _bucket(tmp_path, cut: int | None = None):
    """The flat bucket (one file, or two cut at element `cut`: two DP ranks' shards), the
    parameter's view, its values, the file paths."""
    flat = np.random.default_rng(3).standard_normal(OFF + ROWS * COLS + 24).astype(np.float32)
    cuts = [0, flat.size] if cut is None else [0, cut, flat.size]
    parts, paths = rank_files(tmp_path, flat, cuts)
    bucket = parts[0] if len(parts) == 1 else lazy.concat(parts, 0)
    param = lazy.reshape(lazy.slice_axis(bucket, 0, OFF, OFF + ROWS * COLS), (ROWS, COLS))
    return param, flat[OFF: OFF + ROWS * COLS].reshape(ROWS, COLS), paths


@pytest.fixture
def counted(monkeypatch):
    """Calls of `read_flat` (the per-run path through the views) and of the element copy."""
    seen = {"read_flat": 0, "copy_into": 0, "transposed_rows": 0}
    for mod, name in ((lazy.LazyTensor, "read_flat"), (element_copy, "transposed_rows")):
        real = getattr(mod, name)

        def wrap(*a, _real=real, _name=name, **k):
            seen[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, wrap)
    real_copy = element_copy.copy_into

    def copy(out, src):
        seen["copy_into"] += 1
        return real_copy(out, src)

    for mod in (views, stored, element_copy):
        monkeypatch.setattr(mod, "copy_into", copy)
    return seen


def test_a_whole_parameter_is_one_pread_into_out(tmp_path, counted):
    param, want, (path,) = _bucket(tmp_path)
    out = np.empty((ROWS, COLS), np.float32)
    with count_reads() as c:
        param.read_into(((0, ROWS), (0, COLS)), out)
    assert np.array_equal(out, want)
    assert c[(path, "calls")] == 1 and c[path] == want.nbytes
    assert counted == {"read_flat": 0, "copy_into": 0, "transposed_rows": 0}  # before: 1 read_flat, its copy


def test_whole_rows_into_a_transposed_tile_are_read_into_the_staging_rows(tmp_path, counted):
    param, want, (path,) = _bucket(tmp_path)
    kernel = lazy.Transpose(param, (1, 0))  # [COLS, ROWS], as an import's tile of an [out, in] weight
    box = ((0, COLS), (64, 192))  # rows 64..191 of the parameter: one run of the bucket
    with count_reads() as c:
        got = kernel.read_box(box)
    assert np.array_equal(got, want[64:192].T)
    assert c[path] == got.nbytes and c[(path, "calls")] == 1  # one strip of 128 whole rows
    # before: read_flat into a fresh array, copied into a second, then the transposing copy
    assert counted == {"read_flat": 0, "copy_into": 0, "transposed_rows": 1}


def test_a_run_across_the_dp_cut_is_read_per_file_into_out(tmp_path, counted):
    param, want, paths = _bucket(tmp_path, cut=OFF + 100 * COLS + 7)
    out = np.empty((ROWS, COLS), np.float32)
    with count_reads() as c:
        param.read_into(((0, ROWS), (0, COLS)), out)
    assert np.array_equal(out, want)
    assert [c[(p, "calls")] for p in paths] == [1, 1] and sum(c[p] for p in paths) == want.nbytes
    assert counted["read_flat"] == 0 and counted["copy_into"] == 0  # before: read_flat, then its copy
