"""Raw chunk files written by `store.chunk_files`, read back by TensorStore's own zarr driver:
edge chunks padded to whole chunks, 0-d arrays, tiles of several chunks, and the write specs
that must stay with TensorStore (compressed, OCDBT, Fortran order)."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from hybridckpt.store import chunk_files


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
    chunk_files.sync_folder(path)
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
