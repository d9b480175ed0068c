"""Tensors whose bytes already lie in files are copied file to file: the runs are the exact bytes
of every box, the copy equals a read-and-write, and the writer's output is byte-identical."""

import os

import numpy as np
import pytest
from fixtures.lazy_views import SETTINGS, boxes, composed, stored_in_blob
from hypothesis import given
from hypothesis import strategies as st

from hybridckpt import lazy
from hybridckpt.containers import safetensors_file as sf
from hybridckpt.errors import FormatError
from hybridckpt.io import byte_source, writeback
from hybridckpt.io.byte_source import ByteSource, count_reads

UNLIMITED = 10**9


def _bytes_of(runs) -> bytes:
    return b"".join(r.source.read(r.offset, r.nbytes) for r in runs)


# the views that only rearrange stored bytes (no cast, take, transpose or in-memory part)
BYTE_PRESERVING = ("slice", "reshape", "concat", "stack", "index0")


@SETTINGS
@given(data=st.data())
def test_runs_of_byte_preserving_views_are_the_box_bytes(blob, data):
    t, ref = data.draw(composed(blob, BYTE_PRESERVING, in_memory=False))
    box = data.draw(boxes(t.shape))
    runs = t.file_runs(box, UNLIMITED)
    assert runs is not None, "views that only rearrange stored bytes always have runs"
    assert _bytes_of(runs) == np.ascontiguousarray(ref[tuple(slice(a, b) for a, b in box)]).tobytes()
    assert all(r.nbytes > 0 for r in runs)
    touching = [(a, b) for a, b in zip(runs, runs[1:], strict=False) if a.source == b.source and a.offset + a.nbytes == b.offset]
    assert not touching, "touching runs are merged"


@SETTINGS
@given(data=st.data())
def test_runs_of_any_view_are_none_or_the_box_bytes(blob, data):
    t, ref = data.draw(composed(blob))
    box = data.draw(boxes(t.shape))
    runs = t.file_runs(box, UNLIMITED)
    if runs is not None:
        want = np.ascontiguousarray(ref[tuple(slice(a, b) for a, b in box)])
        assert _bytes_of(runs) == want.astype(t.dtype).tobytes()


def test_what_has_runs_and_what_does_not(blob):
    a, _ = stored_in_blob(blob, (4, 8))
    b, _ = stored_in_blob(blob, (4, 8), 100)
    assert len(lazy.Concat((a, b), 0).file_runs(lazy.full_box((8, 8)), 8)) == 2
    # joined on dim 1: every row alternates between the parts
    assert len(lazy.Concat((a, b), 1).file_runs(lazy.full_box((4, 16)), UNLIMITED)) == 8
    assert lazy.Concat((a, b), 1).file_runs(lazy.full_box((4, 16)), 7) is None  # over the limit
    assert lazy.transpose(a).file_runs(lazy.full_box((8, 4)), UNLIMITED) is None
    assert lazy.transpose(lazy.transpose(a)) is a  # and import-then-export transposes cancel:
    stacked = lazy.Stack((lazy.transpose(a), lazy.transpose(b)))
    assert lazy.transpose(lazy.index0(stacked, 1)) is b
    assert lazy.Cast(a, np.dtype(np.float64)).file_runs(lazy.full_box(a.shape), UNLIMITED) is None
    assert lazy.ArrayTensor(np.zeros(3)).file_runs(((0, 3),), UNLIMITED) is None
    # a transpose that only moves unit dims keeps the C order
    col = lazy.Slice(a, ((0, 4), (2, 3)))
    assert _bytes_of(lazy.transpose(col).file_runs(((0, 1), (0, 4)), UNLIMITED)) == col.materialize().tobytes()


def test_copy_runs_policy_prefers_reading_scattered_small_runs(tmp_path):
    path = tmp_path / "w.bin"
    np.zeros(1 << 20, np.float32).tofile(path)  # 4 MiB
    src = ByteSource(str(path))
    left = lazy.StoredTensor(src, 0, (1024, 512), np.dtype(np.float32))
    right = lazy.StoredTensor(src, 2 << 20, (1024, 512), np.dtype(np.float32))
    assert lazy.copy_runs(lazy.Concat((left, right), 0)) is not None  # two 2 MiB runs
    # row-interleaved: 2048 runs of 2 KiB average far below MIN_COPY_RUN_BYTES
    assert lazy.Concat((left, right), 1).file_runs(lazy.full_box((1024, 1024)), UNLIMITED) is not None
    assert lazy.copy_runs(lazy.Concat((left, right), 1)) is None


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "pread_pwrite"])
def test_copy_to_equals_the_bytes_and_is_counted(tmp_path, monkeypatch, kernel):
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    data.tofile(tmp_path / "src.bin")
    monkeypatch.setattr(byte_source, "_HAS_COPY_FILE_RANGE", kernel and hasattr(os, "copy_file_range"))
    monkeypatch.setattr(byte_source, "COPY_BUFFER_BYTES", 1 << 20)  # several fallback steps
    src = ByteSource(str(tmp_path / "src.bin"))
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.pwrite(fd, b"head", 0)
        with count_reads() as c:
            src.copy_to(1000, 2_500_000, fd, 4)
    finally:
        os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == b"head" + data[1000:2_501_000].tobytes()
    assert c[src.path] == 2_500_000


def test_copy_to_falls_back_when_the_kernel_refuses(tmp_path, monkeypatch):
    import errno

    def refuse(*a):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    (tmp_path / "src.bin").write_bytes(bytes(range(256)) * 16)
    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    monkeypatch.setattr(byte_source, "_HAS_COPY_FILE_RANGE", True)
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    try:
        ByteSource(str(tmp_path / "src.bin")).copy_to(10, 3000, fd, 0)
    finally:
        os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == (bytes(range(256)) * 16)[10:3010]


def test_copy_from_a_truncated_file_names_it(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(FormatError, match=r"short.bin: truncated: wanted bytes \[50, 250\)"):
            ByteSource(str(tmp_path / "short.bin")).copy_to(50, 200, fd, 0)
    finally:
        os.close(fd)


def test_writer_output_is_identical_whether_copied_or_read(tmp_path):
    rng = np.random.default_rng(1)
    halves = [rng.standard_normal((64, 1024)).astype(np.float32) for _ in range(2)]
    small = rng.standard_normal((7,)).astype(np.float32)
    for i, h in enumerate(halves):
        h.tofile(tmp_path / f"rank{i}.bin")
    small.tofile(tmp_path / "small.bin")
    parts = [lazy.StoredTensor(ByteSource(str(tmp_path / f"rank{i}.bin")), 0, (64, 1024), np.dtype(np.float32)) for i in range(2)]
    lazy_tensors = {
        "rows": lazy.Concat(tuple(parts), 0),  # copied: two runs
        "cols": lazy.Concat(tuple(parts), 1),  # read: 128 runs of 4 KiB
        "small": lazy.StoredTensor(ByteSource(str(tmp_path / "small.bin")), 0, (7,), np.dtype(np.float32)),
        "cast": lazy.cast(parts[0], np.float16),  # read: a cast
    }
    assert [lazy.copy_runs(lazy_tensors[k]) is not None for k in ("rows", "cols", "small", "cast")] == [True, False, True, False]
    in_memory = {k: v.materialize() for k, v in lazy_tensors.items()}
    sf.write(str(tmp_path / "lazy.safetensors"), lazy_tensors, {"format": "pt"})
    sf.write(str(tmp_path / "mem.safetensors"), in_memory, {"format": "pt"})
    got = (tmp_path / "lazy.safetensors").read_bytes()
    assert got == (tmp_path / "mem.safetensors").read_bytes()
    from safetensors.numpy import load

    loaded = load(got)
    np.testing.assert_array_equal(loaded["rows"], np.concatenate(halves, 0))
    np.testing.assert_array_equal(loaded["cols"], np.concatenate(halves, 1))


def test_start_writeback_is_best_effort(tmp_path):
    fd = os.open(tmp_path / "f.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 8192)
        writeback.start_writeback(fd, 0, 8192)
    finally:
        os.close(fd)
    writeback.start_writeback(fd, 0, 8192)  # a closed descriptor: ignored, not raised
