"""SequentialFile: a file written front to back through two aligned buffers with O_DIRECT (an
export's safetensors files). The bytes are the same whatever the mix of writes and stored runs,
direct or buffered, and whatever the filesystem refuses; errors of the background write surface."""

import errno
import os

import numpy as np
import pytest
from fixtures.direct_probe import direct_supported

from hybridckpt.io import direct_io, sequential_file
from hybridckpt.io.byte_source import ByteSource, close_all, count_reads
from hybridckpt.io.sequential_file import SequentialFile

BUF = 4 * direct_io.DIRECT_ALIGN  # 16 KiB buffers: every boundary case in a few KiB


def _write_mix(path, src, rng, direct):
    """Random writes and stored runs (sizes across every buffer and block boundary); returns the
    expected bytes and the writer's reported size."""
    blob = np.fromfile(src, np.uint8)
    want = bytearray()
    with SequentialFile(path, direct=direct, buffer_bytes=BUF) as out:
        for n in (0, 1, 4095, 4096, 4097, BUF - 1, BUF, 3 * BUF + 5, 7, 2 * BUF):
            if rng.random() < 0.5:
                data = rng.integers(0, 256, n, dtype=np.uint8)
                out.write(data)
                want += data.tobytes()
            else:
                at = int(rng.integers(0, len(blob) - n + 1))
                out.copy_run(ByteSource(src), at, n)
                want += blob[at : at + n].tobytes()
            assert out.position == len(want)
    return bytes(want)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_the_file_is_the_bytes_written_whatever_the_mix(tmp_path, direct):
    src = str(tmp_path / "src.bin")
    np.random.default_rng(0).integers(0, 256, 10 * BUF, dtype=np.uint8).tofile(src)
    for seed in range(6):
        path = str(tmp_path / f"out{seed}.bin")
        want = _write_mix(path, src, np.random.default_rng(seed), direct)
        with open(path, "rb") as f:
            assert f.read() == want, seed
    close_all()


@pytest.mark.parametrize("mode", ["direct", "refused"])
def test_full_buffers_go_direct_and_stored_runs_are_read_into_them(tmp_path, monkeypatch, mode):
    """Where the filesystem takes O_DIRECT, every full buffer is written through the O_DIRECT
    descriptor (aligned offsets, whole blocks), only the last partial block buffered, and a stored
    run is read into the buffer (counted as read), not copied by the kernel. Where it refuses
    O_DIRECT ("refused", or a CI filesystem that does), the writer says so, writes what it holds
    buffered and has the kernel copy the run (`copy_file_range`)."""
    monkeypatch.setattr(direct_io, "_refused", set())
    if mode == "refused":
        direct_io._refused.add(os.stat(tmp_path).st_dev)
    supported = direct_supported(str(tmp_path))
    src = str(tmp_path / "src.bin")
    np.arange(3 * BUF, dtype=np.uint8).tofile(src)
    writes, copies, real, real_copy = [], [], os.pwrite, ByteSource.copy_to
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: writes.append((fd, len(data), at)) or real(fd, data, at))
    monkeypatch.setattr(ByteSource, "copy_to", lambda self, *a: copies.append(a[:2]) or real_copy(self, *a))
    path = str(tmp_path / "out.bin")
    with count_reads() as c, SequentialFile(path, buffer_bytes=BUF) as out:
        out.write(b"h" * 100)
        out.copy_run(ByteSource(src), 0, 3 * BUF)
        assert out.direct == supported
        direct_fd = out._dfd
    assert c[src] == 3 * BUF
    direct = [(n, at) for fd, n, at in writes if fd == direct_fd]
    buffered = [(n, at) for fd, n, at in writes if fd != direct_fd]
    if supported:
        assert [at for _, at in direct] == [0, BUF, 2 * BUF] and all(n == BUF for n, _ in direct)
        assert buffered == [(100, 3 * BUF)] and copies == []
    else:
        assert direct_fd is None and buffered == [(100, 0)] and copies == [(0, 3 * BUF)]
    with open(path, "rb") as f:
        assert f.read() == b"h" * 100 + np.fromfile(src, np.uint8).tobytes()
    close_all()


@pytest.mark.parametrize("refuse", ["open", "write"])
def test_a_filesystem_refusing_o_direct_gets_the_same_bytes_buffered(tmp_path, monkeypatch, refuse):
    src = str(tmp_path / "src.bin")
    np.random.default_rng(1).integers(0, 256, 10 * BUF, dtype=np.uint8).tofile(src)
    monkeypatch.setattr(direct_io, "_refused", set())
    real_open, real_pwrite, direct_fds = os.open, os.pwrite, set()

    def fake_open(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0) and refuse == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a)
        (direct_fds.add if flags & getattr(os, "O_DIRECT", 0) else direct_fds.discard)(fd)
        return fd

    def fake_pwrite(fd, data, at):
        if fd in direct_fds and refuse == "write":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    path = str(tmp_path / "out.bin")
    want = _write_mix(path, src, np.random.default_rng(3), direct=True)
    with open(path, "rb") as f:
        assert f.read() == want
    assert direct_io.open_direct(str(tmp_path / "again.bin"), os.O_WRONLY | os.O_CREAT) is None  # remembered
    close_all()


def test_an_error_of_the_background_write_surfaces_and_closes_the_file(tmp_path, monkeypatch):
    real = os.pwrite

    def full(fd, data, at):
        if at >= BUF:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, at)

    monkeypatch.setattr(os, "pwrite", full)
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="No space"):
        with SequentialFile(str(tmp_path / "out.bin"), buffer_bytes=BUF) as out:
            for _ in range(8):
                out.write(b"x" * BUF)
    assert len(os.listdir("/proc/self/fd")) == fds_before
    with pytest.raises(ValueError, match="multiple of 4096"):
        SequentialFile(str(tmp_path / "bad.bin"), buffer_bytes=1000)
    assert sequential_file.BUFFER_BYTES % direct_io.DIRECT_ALIGN == 0
