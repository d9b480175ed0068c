"""Our store imported with `--compression zstd` (an OCDBT database of compressed chunks), read
from a bucket by TensorStore itself (issue 43, `io.remote.ts_kvstore`): equal to the local read
bit for bit, its data files never downloaded whole (its `restore()`: test_restore_ocdbt_bucket.py).
"""

from __future__ import annotations

import os

import pytest
from meshes import fit
from test_export_s3 import cli, client
from test_tensorstore_from_bucket import object_bytes, tensors

import hybridckpt
from hybridckpt.demo import sample_path
from hybridckpt.formats.registry import open_source
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import remote_requests


@pytest.fixture(scope="module")
def zstd_store(s3_shared, tmp_path_factory):
    """(local folder, URL): one import with --compression zstd (an OCDBT item of zstd chunks) to
    disk and the same import to the bucket."""
    from fixtures import s3_server

    with pytest.MonkeyPatch.context() as mp:
        s3_server.apply_env(mp, s3_shared)
        fs = client(s3_shared)
        fs.mkdir("ts-store")
        local = tmp_path_factory.mktemp("zstd") / "ck"
        for dst in (local, "s3://ts-store/zstd"):
            assert hybridckpt.cli.main(["import", sample_path(), str(dst), "--compression", "zstd",
                                        "--mesh", fit("fsdp=2")]) == 0
    assert any(f == "manifest.ocdbt" for _, _, fs_ in os.walk(local) for f in fs_)
    return str(local), "s3://ts-store/zstd"


def test_an_ocdbt_compressed_store_from_s3_equals_the_local_one(zstd_store, s3, capsys):
    local, url = zstd_store
    want = tensors(open_source(local))
    with count_reads() as reads:
        got = tensors(open_source(url))
    assert sorted(got) == sorted(want) and len(want) > 20
    assert [k for k in want if got[k] != want[k]] == []  # bitwise, params and optimizer slots
    asked = remote_requests(reads)[f"127.0.0.1:{s3.port}"]
    assert 0 < asked["bytes"] <= object_bytes(local)  # the OCDBT nodes and chunks, none read twice
    from hybridckpt.io.remote import view

    root = view.local_path(url)
    data = [os.path.join(r, f) for r, _, fs_ in os.walk(root) for f in fs_ if os.path.basename(r) == "d"]
    assert data and all(view.remote_object(p) is not None for p in data)  # OCDBT data files: never downloaded
    code, out, err = cli(capsys, "verify", url)
    assert code == 0 and "match" in out, err

