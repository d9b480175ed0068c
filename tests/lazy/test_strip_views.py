"""The Python work of each strip of a transposing read (`StoredTensor._rows_into`): every torch
`[out, in]` weight an import writes as a JAX `[in, out]` kernel goes through it (an HF source is
weights only, so all its bytes), strip by strip of 128 file rows. Per strip the byte views of
the 128 staging rows were made again (`row_views`: a Python memoryview a row) and, in the
page-cache check of each read (`io.direct_read.read`), walked three more times before the
kernel was asked whether the range is cached: ~100 us of a ~400 us strip, under the GIL.
Counted (views made, passes over the rows), not timed; the values read are checked."""

from __future__ import annotations

import numpy as np

from hybridckpt import lazy
from hybridckpt.io import direct_read
from hybridckpt.io.byte_source import ByteSource, count_reads
from hybridckpt.io.read_tally import tally
from hybridckpt.lazy import element_copy, stored

RNG = np.random.default_rng(7)


def test_a_transposed_box_makes_its_staging_rows_views_once(tmp_path, monkeypatch):
    """A `[1000, 640]` weight read into its `[640, 1000]` kernel: strips of STRIP_ROWS rows (the
    last shorter), their views made once for the full strips and once for the short last one
    (before: once a strip, a list of memoryviews each)."""
    x = RNG.standard_normal((1000, 640)).astype(np.float32)  # 2.5 KiB rows: above SCATTER_ROW_BYTES
    t = _stored(tmp_path, x)
    made: list[int] = []
    real = stored.row_views

    def counted(out, *a, **k):
        views = real(out, *a, **k)
        if views is not None:  # (the kernel itself is asked first: its rows are 4 bytes, none)
            made.append(len(views))
        return views
    monkeypatch.setattr(stored, "row_views", counted)
    kernel = np.full((640, 1000), np.nan, np.float32)
    t.read_into(((0, 1000), (0, 640)), kernel.T)
    assert np.array_equal(kernel, x.T)
    h = element_copy.STRIP_ROWS
    assert -(-1000 // h) >= 4 and 1000 % h  # several full strips and a short one
    assert made == [h, 1000 % h]  # before: [h] * (1000 // h) + [1000 % h]


def test_strips_are_256_rows_and_their_staging_buffer_is_kept(tmp_path):
    """Strips of 256 file rows (was 128): a `[1000, 640]` weight into its kernel is 4 preadvs,
    not 8 (and half the strips' numpy calls and Python); the staging rows of the widest fp32
    file row of a Llama import (SwiGLU down_proj: 5632 `in` columns, 5.8 MB for 256 rows) are a
    thread's kept buffer, made once, not a fresh one a box."""
    x = RNG.standard_normal((1000, 640)).astype(np.float32)
    t = _stored(tmp_path, x)
    kernel = np.empty((640, 1000), np.float32)
    with count_reads() as c:
        t.read_into(((0, 1000), (0, 640)), kernel.T)
    assert np.array_equal(kernel, x.T)
    assert tally(c)[1] == 4  # before: 8
    w = RNG.standard_normal((512, 5632)).astype(np.float32)  # [out, in] rows of a down_proj
    t = _stored(tmp_path, w, "down.bin")
    tile = np.empty((5632, 512), np.float32)
    t.read_into(((0, 512), (0, 5632)), tile.T)
    made = element_copy.stage_allocations[0]
    for _ in range(3):
        t.read_into(((0, 512), (0, 5632)), tile.T)
    assert np.array_equal(tile, w.T)
    assert element_copy.stage_allocations[0] == made  # kept: reused box after box
    assert element_copy.kept_stage_bytes() >= 256 * 5632 * 4  # before: 4 MiB kept at most, this not


def _stored(tmp_path, x: np.ndarray, name: str = "w.bin") -> lazy.StoredTensor:
    path = str(tmp_path / name)
    x.tofile(path)
    return lazy.StoredTensor(ByteSource(path), 0, x.shape, x.dtype)


class _Rows(list):
    """The staging rows' views, counting the Python passes made over them (`iter`)."""

    passes = 0

    def __iter__(self):
        type(self).passes += 1
        return super().__iter__()


def test_a_warm_read_asks_the_page_cache_before_walking_its_views(tmp_path):
    """A strip read of a page-cache-warm range (`ByteSource.read_scatter`, as `_rows_into` reads
    it): its views walked once (their bytes summed), the kernel asked (`cached_pages`) with that
    total, and read by preadv (before: three more walks of the rows in the page-cache check,
    whatever its answer); cold reads: tests/io/test_direct_read.py."""
    data = RNG.integers(0, 256, 1 << 20, dtype=np.uint8)
    path = str(tmp_path / "f.bin")
    data.tofile(path)
    with open(path, "rb") as f:
        f.read()  # warm
    rows = np.zeros((128, 8192), np.uint8)
    views = _Rows(memoryview(r) for r in rows)
    _Rows.passes = 0
    ByteSource(path).read_scatter(0, views)
    assert rows.tobytes() == data.tobytes()
    assert _Rows.passes == 1  # before: 3 (and a sum over the cast copy of the list)
    with open(path, "rb") as f:  # asked without the total: one pass to sum it (before: 2)
        _Rows.passes = 0
        assert direct_read.read(f.fileno(), 0, views) == 0  # warm: left to the buffered read
        assert _Rows.passes == 1
