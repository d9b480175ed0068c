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
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.lazy import element_copy, stored

RNG = np.random.default_rng(7)


def test_a_transposed_box_makes_its_staging_rows_views_once(tmp_path, monkeypatch):
    """A `[1000, 640]` weight read into its `[640, 1000]` kernel: 8 strips of 128 rows (the last
    104), their views made once for the 7 full strips and once for the short last one (before:
    once a strip, 8 lists of 128 memoryviews)."""
    x = RNG.standard_normal((1000, 640)).astype(np.float32)  # 2.5 KiB rows: above SCATTER_ROW_BYTES
    path = str(tmp_path / "w.bin")
    x.tofile(path)
    t = lazy.StoredTensor(ByteSource(path), 0, x.shape, x.dtype)
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
    strips = -(-1000 // element_copy.STRIP_ROWS)
    assert strips == 8
    assert made == [128, 1000 - 7 * 128]  # before: [128] * 7 + [104]


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
