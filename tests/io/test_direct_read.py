"""Reads of cold file ranges with O_DIRECT (`io.direct_read`, issue 42's cold restore).

A range the page cache does not hold (its pages dropped with `posix_fadvise(DONTNEED)`, which
needs no root and touches no other file) is read from the device straight into the caller's
buffers, through a bounce buffer where they are not aligned; a range it holds is read buffered as
before. Counted, never timed: `count_reads` records the bytes read with O_DIRECT under
`(path, "direct")`, and the O_DIRECT opens are counted at `os.open`. Every read is compared
byte for byte with the file.

Where the filesystem of the test folder cannot drop a file's pages or refuses O_DIRECT (tmpfs
before Linux 6.6), no read goes direct and the bytes are the same: the tests say which case
they met (`fixtures.direct_probe.cold_reads_supported`) and check that one.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from fixtures.direct_probe import cold_reads_supported
from fixtures.direct_probe import drop_pages as _drop

from hybridckpt.errors import FormatError
from hybridckpt.io import direct_read
from hybridckpt.io.byte_source import ByteSource, close_all, count_reads
from hybridckpt.io.direct_io import aligned_empty
from hybridckpt.lazy.stored import row_views

SIZE = 3 * 2**20 + 123  # a tail that is no whole block


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    path = str(tmp_path / "data.bin")
    data.tofile(path)
    yield path, data, cold_reads_supported(str(tmp_path))
    close_all()


@pytest.fixture
def direct_opens(monkeypatch):
    """How many files were opened with O_DIRECT."""
    count, real = [0], os.open

    def counted(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            count[0] += 1
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", counted)
    return count


# (offset, length, buffer aligned?): aligned both; a file offset off the block grid; a buffer
# that is not aligned; the file's tail (not a whole block); a range that ends inside a block
CASES = [(0, 2 * 2**20, True), (4096, 2**20, True), (777, 1_500_000, True), (512, SIZE - 512, True),
         (0, 2**20 + 1000, False), (2**20, SIZE - 2**20, False)]


@pytest.mark.parametrize(("offset", "length", "aligned"), CASES)
def test_a_cold_range_is_read_with_o_direct_and_its_bytes_are_the_file(data_file, direct_opens, offset, length,
                                                                        aligned):
    path, data, capable = data_file
    _drop(path)
    buf = aligned_empty((length,), np.uint8) if aligned else np.empty(length + 1, np.uint8)[1:]
    with count_reads() as counter:
        ByteSource(path).read_into(offset, memoryview(buf))
    assert buf.tobytes() == data[offset: offset + length].tobytes()
    assert counter[path] == length
    assert counter[(path, "direct")] == (length if capable else 0)
    assert direct_opens[0] == (1 if capable else 0)


def test_a_warm_range_is_read_through_the_page_cache(data_file, direct_opens):
    """What the page cache holds is read buffered: no O_DIRECT open, no byte read direct
    (O_DIRECT would read it from the device again)."""
    path, data, _ = data_file
    with open(path, "rb") as f:
        f.read()  # (every page cached)
    buf = aligned_empty((2 * 2**20,), np.uint8)
    with count_reads() as counter:
        ByteSource(path).read_into(0, memoryview(buf))
    assert buf.tobytes() == data[: 2 * 2**20].tobytes()
    assert counter[(path, "direct")] == 0 and direct_opens[0] == 0


def test_a_small_read_stays_buffered(data_file, direct_opens):
    path, data, _ = data_file
    _drop(path)
    buf = aligned_empty((direct_read.DIRECT_MIN_BYTES - 4096,), np.uint8)
    with count_reads() as counter:
        ByteSource(path).read_into(0, memoryview(buf))
    assert buf.tobytes() == data[: len(buf)].tobytes()
    assert counter[(path, "direct")] == 0 and direct_opens[0] == 0


@pytest.mark.parametrize("row", [5632, 16000])  # rows of whole blocks (straight in); of 31.25 blocks (bounced)
def test_a_cold_run_is_read_into_the_rows_of_a_strided_shard(data_file, direct_opens, row):
    """`read_scatter` (a piece of a chunk into its shard's rows): one O_DIRECT open, every row
    the file's bytes in order, the columns beside them untouched."""
    path, data, capable = data_file
    _drop(path)
    rows = 150
    out = aligned_empty((rows, 2 * row), np.uint8)
    out[...] = 0xAB
    half = out[:, row:]
    with count_reads() as counter:
        ByteSource(path).read_scatter(4096, row_views(half))
    assert half.tobytes() == data[4096: 4096 + rows * row].tobytes()
    assert (out[:, :row] == 0xAB).all()
    assert counter[(path, "direct")] == (rows * row if capable else 0)
    assert direct_opens[0] == (1 if capable else 0)


def test_a_cold_range_past_the_end_is_the_same_error_as_a_buffered_one(data_file):
    path, _, _ = data_file
    _drop(path)
    buf = aligned_empty((2 * 2**20,), np.uint8)
    with pytest.raises(FormatError, match=rf"truncated: wanted bytes \[2097152, 4194304\) but the file ends at {SIZE}$"):
        ByteSource(path).read_into(2 * 2**20, memoryview(buf))


def test_a_filesystem_that_refuses_o_direct_is_read_buffered_and_not_asked_again(data_file, monkeypatch):
    """EINVAL at the O_DIRECT open (tmpfs before 6.6, some network filesystems): the bytes come
    buffered, and the filesystem is remembered (no second try)."""
    path, data, _ = data_file
    tries, real = [0], os.open

    def refusing(p, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            tries[0] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(p, flags, *a, **k)

    monkeypatch.setattr(os, "open", refusing)
    monkeypatch.setattr(direct_read, "_align", {})
    monkeypatch.setattr(direct_read, "is_cold", lambda fd, offset, n: True)  # (whatever this filesystem can)
    monkeypatch.setattr(direct_read, "alignment", lambda fd: direct_read._align.get(os.fstat(fd).st_dev, (4096, 4096)))
    for _ in range(2):
        buf = aligned_empty((2**20,), np.uint8)
        with count_reads() as counter:
            ByteSource(path).read_into(0, memoryview(buf))
        assert buf.tobytes() == data[: 2**20].tobytes() and counter[(path, "direct")] == 0
    assert tries[0] == 1


def test_a_path_replaced_after_its_first_read_is_not_followed_by_o_direct(data_file, tmp_path):
    """The O_DIRECT descriptor is the open file reopened (`/proc/self/fd`), never the path again:
    a file renamed over the path after the first read (its descriptor cached) is not what a later
    cold read returns; the first file's bytes are, as a buffered read of the cached descriptor
    gives them."""
    path, data, capable = data_file
    source = ByteSource(path)
    source.read(0, 16)  # (opened and cached)
    _drop(path)  # (the first file cold; the one renamed over it is in the page cache)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * SIZE)
    os.replace(other, path)
    buf = aligned_empty((2**20,), np.uint8)
    with count_reads() as counter:
        source.read_into(0, memoryview(buf))
    assert buf.tobytes() == data[: 2**20].tobytes()
    assert counter[(path, "direct")] == (2**20 if capable else 0)
