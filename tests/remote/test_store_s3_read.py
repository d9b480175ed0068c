"""Our own store read from a bucket (issue 43): `restore("s3://bucket/ck", mesh)`, `export`,
`inspect` and `verify` read the store a `hybridckpt import SRC s3://...` uploaded through a local
view (`io.remote.view`): its metadata downloaded, its raw chunk files read by ranged GETs through
`io.byte_source` (never TensorStore), only once the commit marker is found. Every read equals the
same read of the local import bit for bit.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from fixtures import s3_server
from fixtures.remote_sources import cut_uploads
from meshes import fit, fit_pair
from test_export_s3 import cli, client, local_files, refused

import hybridckpt
from hybridckpt.demo import sample_path
from hybridckpt.errors import CheckpointError
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import remote_requests
from hybridckpt.writers import ownership, remote

MESH, TARGET = fit_pair("fsdp=2,tp=2", "fsdp=4,tp=2")  # a reshard down to 2 devices (1: dp=1 both)


@pytest.fixture(scope="module")
def stores(s3_shared, tmp_path_factory):
    """(fs, url, local folder): one import to the bucket and the same import to disk."""
    with pytest.MonkeyPatch.context() as mp:
        s3_server.apply_env(mp, s3_shared)
        fs = client(s3_shared)
        fs.mkdir("store-read")
        local = tmp_path_factory.mktemp("store") / "ck"
        assert hybridckpt.cli.main(["import", sample_path(), str(local), "--mesh", MESH]) == 0
        assert hybridckpt.cli.main(["import", sample_path(), "s3://store-read/ck", "--mesh", MESH]) == 0
        yield fs, "s3://store-read/ck", local


def leaves(tree) -> dict[str, bytes]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(k): np.asarray(v).tobytes() + str(np.asarray(v).dtype).encode() for k, v in flat}


def test_restore_from_s3_equals_restore_from_the_local_copy(stores, s3):
    fs, url, local = stores
    _, want = hybridckpt.restore(str(local), TARGET)
    with count_reads() as reads:
        _, got = hybridckpt.restore(url, TARGET)
    a, b = leaves((want.params, want.opt_state)), leaves((got.params, got.opt_state))
    assert sorted(a) == sorted(b) and len(a) > 20
    assert [k for k in a if a[k] != b[k]] == []  # bitwise, every leaf
    chunks = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs_ in os.walk(local) for f in fs_
                 if f[0].isdigit() and os.path.exists(os.path.join(r, ".zarray")))
    got_reads = remote_requests(reads)[f"127.0.0.1:{s3.port}"]
    assert 0 < got_reads["bytes"] <= chunks  # the chunks by ranged GETs, none twice, none whole-downloaded twice
    assert got_reads["requests"] <= 2 * len([1 for r, _, fs_ in os.walk(local) for f in fs_ if f[0].isdigit()])


def test_export_inspect_verify_from_s3_equal_the_local_copy(stores, s3, tmp_path, capsys):
    fs, url, local = stores
    assert cli(capsys, "export", local, tmp_path / "a")[0] == 0
    code, _, err = cli(capsys, "export", url, tmp_path / "b")
    assert code == 0, err
    a, b = local_files(tmp_path / "a"), local_files(tmp_path / "b")
    assert sorted(a) == sorted(b) and "model.safetensors" in a
    assert [k for k in a if a[k] != b[k] and k != "hybridckpt.json"] == []
    code, out_a, _ = cli(capsys, "inspect", local, "--json")
    code_b, out_b, err = cli(capsys, "inspect", url, "--json")
    assert code == code_b == 0, err
    ia, ib = json.loads(out_a), json.loads(out_b)
    assert ib.pop("path") == url and ia.pop("path") == str(local)
    assert ia == ib
    code, out, err = cli(capsys, "verify", url)
    assert code == 0 and "match" in out, err


def test_readers_refuse_a_store_cut_short_or_without_its_marker(stores, s3, monkeypatch, capsys, tmp_path):
    fs, url, _ = stores
    monkeypatch.chdir(tmp_path)
    cut_uploads(monkeypatch, 3)  # the server gone after 3 objects, nothing cleaned
    monkeypatch.setattr(remote.RemoteDestination, "_clean", lambda self: None)  # as if killed
    refused(cli(capsys, "import", sample_path(), "s3://store-read/cut"), "upload failed")
    for args in (["inspect", "s3://store-read/cut"], ["export", "s3://store-read/cut", "/nonexistent/x"],
                 ["verify", "s3://store-read/cut"]):
        refused(cli(capsys, *args), "s3://store-read/cut", "not finished writing")
    with pytest.raises(CheckpointError, match="not finished writing"):
        hybridckpt.restore("s3://store-read/cut", "fsdp=1")
    # a whole store copied up without our marker (or its marker removed): refused, nothing read
    fs.copy("store-read/ck", "store-read/nomark", recursive=True)
    fs.rm_file(f"store-read/nomark/{ownership.MARKER}")
    with pytest.raises(CheckpointError, match=f"no {ownership.MARKER} commit marker"):
        hybridckpt.restore("s3://store-read/nomark", "fsdp=1")
    refused(cli(capsys, "inspect", "s3://store-read/nomark"), "no .hybridckpt-export commit marker")
    refused(cli(capsys, "export", "s3://store-read/nomark", "/nonexistent/x"), "commit marker")
    with pytest.raises(CheckpointError, match="commit marker"):  # nothing there at all
        hybridckpt.restore("s3://store-read/absent", "fsdp=1")
    assert os.listdir(tmp_path) == []  # never a local folder named `s3:`


def test_restore_without_verify_reads_from_s3_equals_the_local_restore(stores, s3):
    """`verify_reads=False` (once refused: Orbax would read the view's placeholders) reads the raw
    chunk files by our ranged GETs, unchecked, as the checked restore does (an OCDBT store:
    test_restore_ocdbt_bucket.py)."""
    _, url, local = stores
    _, want = hybridckpt.restore(str(local), fit("tp=2"), verify_reads=False)
    with count_reads() as reads:
        _, got = hybridckpt.restore(url, fit("tp=2"), verify_reads=False)
    a, b = leaves((want.params, want.opt_state)), leaves((got.params, got.opt_state))
    assert sorted(a) == sorted(b) and len(a) > 20 and [k for k in a if a[k] != b[k]] == []
    chunks = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs_ in os.walk(local) for f in fs_
                 if f[0].isdigit() and os.path.exists(os.path.join(r, ".zarray")))
    assert 0 < remote_requests(reads)[f"127.0.0.1:{s3.port}"]["bytes"] <= chunks  # by ranges, none twice


def test_our_store_to_and_from_gcs(gcs, stores, tmp_path, capsys):
    """The same round trip through `gs://` (the GCS emulator): imported there, downloaded it is the
    local import; restored from there, it is the local restore."""
    from gcsfs.core import GCSFileSystem
    from test_remote_import import stable_digest

    _, _, local = stores
    fs = GCSFileSystem(skip_instance_cache=True)
    if not fs.exists("store-gcs"):
        fs.mkdir("store-gcs")
    code, _, err = cli(capsys, "import", sample_path(), "gs://store-gcs/ck", "--mesh", MESH)
    assert code == 0, err
    fs.get("store-gcs/ck/", str(tmp_path / "got") + "/", recursive=True)
    got, want = stable_digest(tmp_path / "got"), stable_digest(local)
    assert got.pop(ownership.MARKER) and sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []
    _, a = hybridckpt.restore(str(local), fit("tp=2"))
    _, b = hybridckpt.restore("gs://store-gcs/ck", fit("tp=2"))
    assert leaves(a.params) == leaves(b.params)
