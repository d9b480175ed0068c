"""How a raw import writes its chunk files (issue 42, the import at the O_DIRECT floor), counted,
never timed: the chunk files made durable by one syncfs per item after the last of them (not an
fsync each), and never committed before; each strip chunk copied once, and checksummed from that
copy; tile buffers lent and reused, not made fresh per tile."""

from __future__ import annotations

import ctypes
import errno
import os
import re

import numpy as np
import pytest
from meshes import fit

from hybridckpt import checksum
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.io import direct_io, writeback
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.store import stream

CHUNK_FILE = re.compile(r"^\d+(\.\d+)*$")  # a raw zarr chunk: its grid position
TMP = ".orbax-checkpoint-tmp"  # an item Orbax has not committed yet (renamed at its commit)


def _chunk_files(root) -> dict[str, int]:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs if CHUNK_FILE.match(f)}


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _spy_syncs(monkeypatch, fail: bool = False) -> dict:
    """Record each fsync of a chunk file and each syncfs (with what the folder's item held then)."""
    seen: dict = {"chunk_fsyncs": 0, "zarray_fsyncs": 0, "syncfs": []}
    real_fsync, real_syncfs = os.fsync, getattr(writeback, "_syncfs", None)

    def fsync(fd):
        name = os.path.basename(_path_of(fd))
        if CHUNK_FILE.match(name):
            seen["chunk_fsyncs"] += 1
        elif name.startswith(".zarray") or os.path.exists(os.path.join(_path_of(fd), ".zarray")):
            seen["zarray_fsyncs"] += 1  # TensorStore's of an array's metadata, or of its folder
        return real_fsync(fd)

    def syncfs(fd):
        item = _path_of(fd)  # (opened on the item's folder)
        seen["syncfs"].append({"item": item, "files": _chunk_files(item),
                               "committed": not item.endswith(TMP) or os.path.exists(os.path.join(item, "commit_success.txt"))})
        if fail:
            ctypes.set_errno(errno.EIO)
            return -1
        return real_syncfs(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(writeback, "_syncfs", syncfs, raising=False)  # (raising: the old code had none, and fails the counts)
    return seen


def _needs_syncfs(path) -> None:
    batched = getattr(writeback, "FilesystemSync", None)
    if batched is not None and batched.open(str(path)) is None:
        pytest.fail(f"{path}: this test needs Linux >= 5.8 and a block-device filesystem (syncfs)")


def test_one_syncfs_per_item_after_its_last_chunk_and_before_its_commit(tmp_path, monkeypatch):
    """Before: an fsync per chunk file, and two per array from TensorStore creating its `.zarray`
    (422 fsyncs for 304 chunk files of a 1.6 GB import, each a journal commit and a device cache
    flush). Now none of those: one syncfs per item, once every chunk file and `.zarray` of the
    item is written, before Orbax commits it."""
    _needs_syncfs(tmp_path)
    seen = _spy_syncs(monkeypatch)
    ck = tmp_path / "ck"
    import_checkpoint(sample_path(), ck, mesh=fit("fsdp=2,tp=2"))
    monkeypatch.undo()
    final = _chunk_files(ck)
    assert final and seen["chunk_fsyncs"] == 0 and seen["zarray_fsyncs"] == 0
    items = sorted(os.path.basename(s["item"]).removesuffix(TMP) for s in seen["syncfs"])
    assert items == ["opt_state", "params"]
    for s in seen["syncfs"]:
        assert not s["committed"]
        # every chunk file of the committed item was there, whole, at its syncfs
        name = os.sep + os.path.basename(s["item"]).removesuffix(TMP) + os.sep
        assert sorted(s["files"].values()) == sorted(n for p, n in final.items() if name in p)
    assert main(["verify", str(ck)]) == 0


def test_without_syncfs_each_chunk_file_is_fsynced(tmp_path, monkeypatch):
    """Where syncfs does not report writeback errors (Linux before 5.8), or the filesystem is not
    a block device's: an fsync per chunk file, as before."""
    monkeypatch.setattr(writeback, "_kernel_version", lambda: (5, 4))
    seen = _spy_syncs(monkeypatch)
    ck = tmp_path / "ck"
    import_checkpoint(sample_path(), ck, mesh=fit("fsdp=2,tp=2"))
    assert seen["syncfs"] == [] and seen["chunk_fsyncs"] == len(_chunk_files(ck)) and seen["zarray_fsyncs"] > 0
    monkeypatch.setattr(writeback, "_kernel_version", lambda: (6, 1))
    anonymous = os.stat_result((0, 0, os.makedev(0, 42), 0, 0, 0, 0, 0, 0, 0))  # major 0: NFS, FUSE, tmpfs, ...
    monkeypatch.setattr(writeback.os, "stat", lambda p: anonymous)
    assert writeback.FilesystemSync.open(str(tmp_path)) is None


def test_a_failed_syncfs_fails_the_import_and_commits_nothing(tmp_path, monkeypatch, capsys):
    _needs_syncfs(tmp_path)
    seen = _spy_syncs(monkeypatch, fail=True)
    ck = tmp_path / "ck"
    assert main(["import", sample_path(), str(ck), "--mesh", fit("fsdp=2,tp=2"), "--quiet"]) != 0
    assert len(seen["syncfs"]) >= 1
    assert not ck.exists() or not any(CHUNK_FILE.match(f) for _, _, fs in os.walk(ck) for f in fs)
    assert "syncfs" in capsys.readouterr().err


def test_strip_chunks_are_copied_once_and_checksummed_from_that_copy(tmp_path, monkeypatch):
    """fsdp cuts the sample's `[vocab, embed]` and `[ffn, hidden]` rows: each device's chunk is a
    strip of the tile. Before, the checksum copied every strip out of the tile (a CRC-32 of a
    strided view) and the write copied it again; now the checksum reads the write's copy."""
    real = checksum.crc32_of
    strided: list[int] = []

    def crc32_of(data):
        if not data.flags.c_contiguous:
            strided.append(data.nbytes)
        return real(data)

    monkeypatch.setattr(checksum, "crc32_of", crc32_of)
    ck = tmp_path / "ck"
    import_checkpoint(sample_path(), ck, mesh=fit("fsdp=4"))
    monkeypatch.undo()
    assert strided == []
    assert main(["verify", str(ck)]) == 0  # the checksums recorded are the files' own


def test_tile_buffers_are_lent_and_reused(tmp_path, monkeypatch):
    """Every tile of a raw import used to be read into a fresh aligned buffer (fresh pages: the
    kernel zeroes each one and faults it in). Now a tile borrows one of the save's buffers: here
    dozens of equal tiles share a handful of buffers, and no more bytes than the budget stay held."""
    from hybridckpt.containers.orbax import chunk_files

    made: list[int] = []
    real = direct_io.aligned_empty

    def counted(shape, dtype):
        made.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return real(shape, dtype)

    # where tiles get their buffers: the stream (a fresh one a tile, before) and the pool (after);
    # not the cut's strip copies (chunk_files) nor the read side's spans and bounce buffers
    # (`ByteSource.read_span`, `io.direct_read`: aligned for O_DIRECT reads, none of them a tile)
    from hybridckpt.io import aligned_pool

    for mod in (stream, aligned_pool):
        monkeypatch.setattr(mod, "aligned_empty", counted)
    assert chunk_files.aligned_empty is real
    opts = stream.StreamOptions(tile_bytes=8192, inflight_bytes=65536, chunk_bytes=4096)
    import_checkpoint(sample_path(), tmp_path / "ck", mesh=fit("fsdp=2,tp=2"), stream_options=opts)
    assert opts.stats.tiles >= 40
    # (tiles held at once: one a reader or writer thread, `parallel.write_pool`, here 15-25 buffers
    # made for 46 tiles of two sizes; a fresh buffer a tile would be one a tile and more)
    assert len(made) <= opts.stats.tiles * 3 // 4
    # the budget (the tiles' and a strip's copy a writer thread), and one buffer rounded up to whole MiB
    assert sum(made) <= 65536 + (1 << 20)


def test_the_pool_keeps_at_most_its_limit():
    from hybridckpt.io.aligned_pool import AlignedPool

    pool = AlignedPool(3 << 20)
    with pool.lend((1 << 20,), np.uint8) as a, pool.lend((1 << 18,), np.float32) as b:
        assert a.ctypes.data % direct_io.DIRECT_ALIGN == 0 and b.ctypes.data % direct_io.DIRECT_ALIGN == 0
        a[...], b[...] = 1, 2.5
    with pool.lend((1 << 20,), np.uint8), pool.lend((1 << 18,), np.float32):
        pass
    assert (pool.allocations, pool.reuses) == (2, 2)
    with pool.lend((4 << 20,), np.uint8):  # larger than the limit: the free ones are dropped first
        pass
    assert pool.allocations == 3 and pool._held == 0  # (and it is not kept: over the limit)
    pool.clear()


def test_strip_copies_use_lent_buffers(tmp_path, monkeypatch):
    """The one copy of a strip chunk (`chunk_files._chunk_bytes`) went into a fresh aligned buffer
    per chunk (60 on the sample onto fsdp=4: fresh pages each); now into one lent by the save's
    pool: none made by the cut."""
    from hybridckpt.containers.orbax import chunk_files

    real = direct_io.aligned_empty
    made: list[int] = []

    def counted(shape, dtype):
        made.append(int(np.prod(shape)))
        return real(shape, dtype)

    monkeypatch.setattr(chunk_files, "aligned_empty", counted)
    ck = tmp_path / "ck"
    import_checkpoint(sample_path(), ck, mesh=fit("fsdp=4"))
    monkeypatch.undo()
    assert made == []
    assert main(["verify", str(ck)]) == 0
