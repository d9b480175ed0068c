"""Raw chunk files written by `containers.orbax.chunk_files`, read back by TensorStore's own zarr driver:
edge chunks padded to whole chunks, 0-d arrays, tiles of several chunks, and the write specs
that must stay with TensorStore (compressed, OCDBT, Fortran order)."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from fixtures.direct_probe import direct_supported
from fixtures.store_files import assert_same_chunk_files
from meshes import fit

from hybridckpt.containers.orbax import chunk_files
from hybridckpt.io import direct_io
from hybridckpt.io.writeback import fsync_folder


def _create(path: str, shape, chunks, dtype: str) -> dict:
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": path},
            "metadata": {"shape": list(shape), "chunks": list(chunks), "dtype": dtype, "compressor": None}}
    ts.open(spec, create=True).result()  # writes the .zarray, as the primary process does
    return spec


@pytest.mark.parametrize(("shape", "chunks", "dtype", "np_dtype"), [
    ((10, 7), (4, 3), "<f4", np.float32),  # edge chunks on both axes: padded
    ((6, 5), (2, 5), "bfloat16", ml_dtypes.bfloat16),  # whole rows: tiles of several chunks
    ((), (), "<i4", np.int32),  # a 0-d counter: one chunk named "0"
])
def test_chunk_files_are_what_tensorstore_reads(tmp_path, shape, chunks, dtype, np_dtype):
    path = str(tmp_path / "arr")
    spec = _create(path, shape, chunks, dtype)
    target = chunk_files.target_of(dict(spec, dtype=dtype), tuple(chunks))
    assert target is not None and target.folder == path
    x = (np.random.default_rng(0).standard_normal(shape) * 100).astype(np_dtype)
    if shape:  # tiles of two chunks along dim 0 (the last one clipped at the edge)
        step = 2 * chunks[0]
        for a in range(0, shape[0], step):
            box = ((a, min(shape[0], a + step)), *((0, n) for n in shape[1:]))
            chunk_files.write_tile(target, box, x[box[0][0] : box[0][1]])
    else:
        chunk_files.write_tile(target, (), x)
    fsync_folder(path)
    got = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}).result().read().result()
    assert np.asarray(got).tobytes() == x.tobytes()
    names = sorted(n for n in os.listdir(path) if n != ".zarray")
    if shape:
        grid = [-(-n // c) for n, c in zip(shape, chunks, strict=True)]
        assert len(names) == int(np.prod(grid))
        whole = int(np.prod(chunks)) * x.dtype.itemsize
        assert all(os.path.getsize(os.path.join(path, n)) == whole for n in names)  # edges padded
    else:
        assert names == ["0"]


def test_specs_tensorstore_must_write_are_left_to_it():
    base = {"driver": "zarr", "kvstore": {"driver": "file", "path": "/x/a"},
            "metadata": {"shape": [4], "chunks": [2], "compressor": None}}
    assert chunk_files.target_of(base, (2,)) is not None
    compressed = json.loads(json.dumps(base))
    compressed["metadata"]["compressor"] = {"id": "zstd", "level": 1}
    fortran = json.loads(json.dumps(base))
    fortran["metadata"]["order"] = "F"
    ocdbt = dict(base, kvstore={"driver": "ocdbt", "base": "file:///x/"})
    cast = {"driver": "cast", "base": base, "dtype": "float32"}
    for spec in (compressed, fortran, ocdbt, cast):
        assert chunk_files.target_of(spec, (2,)) is None


def _spy_opens(monkeypatch, refuse: str = ""):
    """Record the flags of every file chunk_files opens; with `refuse` "open" or "write", an
    O_DIRECT open or write fails with EINVAL as on a filesystem without O_DIRECT."""
    import errno

    opened, direct_fds = [], set()
    real_open, real_write = os.open, os.write

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT and refuse == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a)
        opened.append((os.path.basename(path), bool(flags & os.O_DIRECT)))
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        else:
            direct_fds.discard(fd)  # a number reused after a direct file was closed
        return fd

    def fake_write(fd, data):
        if fd in direct_fds and refuse == "write":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(chunk_files.os, "open", fake_open)
    monkeypatch.setattr(chunk_files.os, "write", fake_write)
    monkeypatch.setattr(direct_io, "_refused", set())
    return opened


@pytest.mark.parametrize("refuse", ["", "open", "write"])
def test_whole_block_chunks_go_direct_and_fall_back_to_buffered(tmp_path, monkeypatch, refuse):
    """Chunks of whole 4 KiB blocks from aligned buffers are written with O_DIRECT where the
    filesystem takes it; a refusal at open or at write (EINVAL) falls back to buffered writes,
    for the rest of the process on that filesystem; the files hold the same bytes either way."""
    path = str(tmp_path / "arr")
    spec = _create(path, (8, 2048), (2, 2048), "<f4")  # 16 KiB chunks
    small = str(tmp_path / "small")
    small_spec = _create(small, (4, 3), (2, 3), "<f4")  # 24-byte chunks: always buffered
    supported = direct_supported(str(tmp_path))  # (before the spy: it patches the os module)
    opened = _spy_opens(monkeypatch, refuse)
    x = np.random.default_rng(1).standard_normal((8, 2048)).astype(np.float32)
    buf = direct_io.aligned_empty(x.shape, x.dtype)
    buf[...] = x
    target = chunk_files.target_of(spec, (2, 2048))
    chunk_files.write_tile(target, ((0, 4), (0, 2048)), buf[:4])
    chunk_files.write_tile(target, ((4, 8), (0, 2048)), buf[4:])
    y = np.arange(12, dtype=np.float32).reshape(4, 3)
    chunk_files.write_tile(chunk_files.target_of(small_spec, (2, 3)), ((0, 4), (0, 3)), y)
    got = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}).result().read().result()
    assert np.asarray(got).tobytes() == x.tobytes()
    got = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": small}}).result().read().result()
    assert np.asarray(got).tobytes() == y.tobytes()
    direct = [name for name, d in opened if d]
    if refuse == "open" or not supported:
        assert direct == []
    elif refuse == "write":  # tried once, then buffered for the rest
        assert len(direct) == 1 and len([n for n, d in opened if not d]) == 4 + 2
    else:
        assert sorted(direct) == ["0.0", "1.0", "2.0", "3.0"]  # the small array's chunks buffered
        assert len(opened) == 4 + 2
    assert chunk_files.target_of(spec, (2, 2048), direct=False).direct is False


def test_an_import_writes_the_same_chunk_files_direct_or_buffered(tmp_path, capsys):
    from hybridckpt.cli import main
    from hybridckpt.demo import sample_path

    outs = {}
    for flag in ("", "--buffered-writes"):
        outs[flag] = str(tmp_path / (flag or "direct"))
        assert main(["import", sample_path(), outs[flag], "--mesh", fit("fsdp=2,tp=2,pp=2"), "--quiet", *filter(None, [flag])]) == 0
    assert_same_chunk_files(outs[""], outs["--buffered-writes"])
    assert main(["verify", outs[""]]) == 0


def test_chunks_side_by_side_in_a_tile_go_direct(tmp_path, monkeypatch):
    """A tile of several chunks along a later axis (the joined strips of an fsdp-cut row: each
    chunk a strip of the tile, not a contiguous part of it) is cut into aligned chunk buffers and
    written with O_DIRECT like any whole-block chunk, one copy each; before, each strip was made
    contiguous in an unaligned buffer and went through the page cache (a second copy, in the
    kernel): 4 buffered files here."""
    path = str(tmp_path / "arr")
    spec = _create(path, (4, 4096), (4, 1024), "<f4")  # 16 KiB chunks, 4 side by side
    if not direct_supported(str(tmp_path)):
        pytest.fail(f"{tmp_path}: this test needs a filesystem that takes O_DIRECT")
    opened = _spy_opens(monkeypatch)
    x = np.random.default_rng(2).standard_normal((4, 4096)).astype(np.float32)
    buf = direct_io.aligned_empty(x.shape, x.dtype)
    buf[...] = x
    chunk_files.write_tile(chunk_files.target_of(spec, (4, 1024)), ((0, 4), (0, 4096)), buf)
    assert sorted(opened) == [("0.0", True), ("0.1", True), ("0.2", True), ("0.3", True)]
    got = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}).result().read().result()
    assert np.asarray(got).tobytes() == x.tobytes()
