"""An import with `--compression zstd` into a bucket (issue 43): TensorStore writes its OCDBT
databases (the compressed chunks) to the bucket itself (`io.remote.ts_writes`), so the spool holds
Orbax's small metadata files only, never chunk data: counted in bytes at every upload and at
every tile handed to TensorStore, never timed. The result equals the local import: every OCDBT
key (each array's `.zarray` and zstd chunks) bit for bit, every other file bit for bit, every
tensor read back bit for bit. A server killed while TensorStore writes ends the job early in one
line, exit 2, no commit marker; a failure after TensorStore wrote deletes what it wrote.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import tensorstore as ts
from meshes import fit
from test_export_s3 import cli, client, refused
from test_remote_import import stable_digest
from test_tensorstore_from_bucket import tensors

from hybridckpt.demo import sample_path
from hybridckpt.formats.registry import open_source
from hybridckpt.io.remote import commit as markers
from hybridckpt.store import stream
from hybridckpt.writers import ownership, remote

ARGS = ("--compression", "zstd", "--mesh", fit("fsdp=2"))


def _ocdbt_file(rel: str) -> bool:
    """Whether the spool or store file `rel` belongs to an OCDBT database (chunk data, manifests)."""
    parts = rel.replace(os.sep, "/").split("/")
    return parts[-1] == "manifest.ocdbt" or "d" in parts[:-1] or any(p.startswith("ocdbt.process_") for p in parts)


def _files(root) -> dict[str, int]:
    out = {}
    for r, _, fs in os.walk(root):
        for f in fs:
            try:
                out[os.path.relpath(os.path.join(r, f), root)] = os.path.getsize(os.path.join(r, f))
            except FileNotFoundError:  # (removed meanwhile)
                pass
    return out


@pytest.fixture(scope="module")
def local_zstd(tmp_path_factory):
    """(folder, tiles): the local import every test compares with, and how many tiles it read."""
    from hybridckpt.cli import main

    folder = tmp_path_factory.mktemp("zstd") / "local"
    read = []
    real = stream.read_tile
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "read_tile", lambda *a, **k: (read.append(1), real(*a, **k))[1])
        assert main(["import", sample_path(), str(folder), *ARGS]) == 0
    return folder, len(read)


@pytest.fixture
def spool(tmp_path, monkeypatch):
    """The spool's parent folder and what it held (OCDBT bytes, all bytes) at each upload and at
    each tile read for TensorStore to write."""
    where = tmp_path / "spooltmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    seen: list[tuple[str, int, int]] = []

    def measure(when: str) -> None:
        files = _files(where)
        seen.append((when, sum(n for f, n in files.items() if _ocdbt_file(f)), sum(files.values())))

    real_upload, real_read = remote.upload_file, stream.read_tile
    monkeypatch.setattr(remote, "upload_file", lambda *a, **k: (measure("upload"), real_upload(*a, **k))[1])
    monkeypatch.setattr(stream, "read_tile", lambda *a, **k: (measure("tile"), real_read(*a, **k))[1])
    return where, seen


def ocdbt_items(root) -> dict[str, dict[bytes, bytes]]:
    """Each OCDBT item database under the local store `root` (a folder holding `manifest.ocdbt`
    directly): its keys and values, read by TensorStore."""
    out = {}
    for r, _, fs in os.walk(root):
        if "manifest.ocdbt" in fs and not os.path.basename(r).startswith("ocdbt.process_"):
            kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{r}/"}).result()
            out[os.path.relpath(r, root)] = {k: kv.read(k).result().value for k in kv.list().result()}
    return out


def test_a_zstd_import_into_s3_is_written_by_tensorstore_and_equals_the_local_one(s3, spool, local_zstd, tmp_path,
                                                                                capsys):
    where, seen = spool
    fs = client(s3)
    fs.mkdir("native")
    here = local_zstd[0]
    local = _files(here)
    metadata = sum(n for f, n in local.items() if not _ocdbt_file(f))
    assert sum(n for f, n in local.items() if _ocdbt_file(f)) > 5 * metadata  # (the chunks: the bulk)

    code, _, err = cli(capsys, "import", sample_path(), "s3://native/ck", *ARGS)
    assert code == 0, err
    tiles = [s for s in seen if s[0] == "tile"]
    assert len(tiles) > 30 and any(s[0] == "upload" for s in seen)
    assert [s for s in seen if s[1]] == []  # not one byte of an OCDBT database in the spool, ever
    assert max(total for *_, total in seen) <= metadata + 1024  # (the spool: the metadata, its paths aside)
    assert os.listdir(where) == []

    fs.invalidate_cache()
    fs.get("native/ck/", str(tmp_path / "fetched") + "/", recursive=True)
    marker = json.loads((tmp_path / "fetched" / ownership.MARKER).read_text())
    fetched = _files(tmp_path / "fetched")
    assert sorted(marker["files"]) == sorted(f for f in fetched if f != ownership.MARKER)
    assert all(marker["sizes"][f] == fetched[f] for f in marker["files"])
    # the OCDBT files by their folders (data files have random names), the rest by name
    shape = sorted({f if not f.split("/")[-2:-1] == ["d"] else f.rsplit("/", 1)[0] + "/*" for f in local})
    assert sorted({f if not f.split("/")[-2:-1] == ["d"] else f.rsplit("/", 1)[0] + "/*"
                   for f in fetched if f != ownership.MARKER}) == shape
    want, got = stable_digest(here), stable_digest(tmp_path / "fetched")
    assert [k for k in want if not _ocdbt_file(k) and got[k] != want[k]] == []  # metadata bitwise
    a, b = ocdbt_items(here), ocdbt_items(tmp_path / "fetched")
    assert sorted(a) == sorted(b) == ["12/opt_state", "12/params"]
    for item in a:  # every key of every item's database (`.zarray`s, zstd chunks) bitwise
        assert sorted(a[item]) == sorted(b[item]) and len(a[item]) > 10
        assert [k for k in a[item] if a[item][k] != b[item][k]] == []
    assert tensors(open_source(str(tmp_path / "fetched"))) == tensors(open_source(str(here)))


def test_the_server_killed_while_tensorstore_writes_ends_the_import_in_one_line(s3_killable, local_zstd,
                                                                               monkeypatch, tmp_path, capsys):
    fs = client(s3_killable)
    fs.mkdir("cut")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "spooltmp"))
    (tmp_path / "spooltmp").mkdir()
    total, read, real = local_zstd[1], [], stream.read_tile
    puts = []
    real_put = remote.RemoteDestination._put
    monkeypatch.setattr(remote.RemoteDestination, "_put",
                        lambda self, name, data: (puts.append(name), real_put(self, name, data))[1])

    def cut(*a, **k):
        read.append(1)
        if len(read) == 8:
            s3_killable.kill()  # TensorStore's writes of this tile and every later request refused
        return real(*a, **k)

    monkeypatch.setattr(stream, "read_tile", cut)
    line = refused(cli(capsys, "import", sample_path(), "s3://cut/ck", *ARGS), "s3://cut/ck")
    assert "\n" not in line.strip() and "Traceback" not in line
    assert markers.STAGING in puts and markers.MARKER not in puts
    assert 8 <= len(read) < total  # the job stopped at the cut, not after reading everything
    assert os.listdir(tmp_path / "spooltmp") == []


def test_a_failure_after_tensorstore_wrote_deletes_what_it_wrote(s3, monkeypatch, tmp_path, capsys):
    fs = client(s3)
    fs.mkdir("clean")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = stream.read_tile
    up = []

    def read_tile(*a, **k):
        if not up:
            fs.invalidate_cache()
            written = [p for p in fs.find("clean/ck") if "/d/" in p]
            if written:  # TensorStore's first data files are in the bucket: now fail
                up.append(written)
                raise OSError("disk read failed (injected)")
        return real(*a, **k)

    monkeypatch.setattr(stream, "read_tile", read_tile)
    refused(cli(capsys, "import", sample_path(), "s3://clean/ck", *ARGS), "injected")
    assert up and len(up[0]) >= 1  # OCDBT data files had gone up before the failure
    fs.invalidate_cache()
    assert fs.find("clean/ck") == []  # all of them deleted, the staging marker last
    assert os.listdir(tmp_path) == []


@pytest.fixture
def gcs_gen(monkeypatch):
    """A GCS emulator of this test's own that answers downloads with `x-goog-generation`, as
    GCS does (`fixtures.gcs_generations`: TensorStore's OCDBT manifest writes need it)."""
    from fixtures import gcs_generations, gcs_server

    server = gcs_generations.start()
    try:
        gcs_server.apply_env(monkeypatch, server)
        yield server
    finally:
        server.kill()


def test_a_zstd_import_into_gcs_is_written_by_tensorstore_and_equals_the_local_one(gcs_gen, spool, local_zstd,
                                                                                 tmp_path, capsys):
    from gcsfs.core import GCSFileSystem

    where, seen = spool
    fs = GCSFileSystem(skip_instance_cache=True)
    fs.mkdir("native-gcs")
    code, _, err = cli(capsys, "import", sample_path(), "gs://native-gcs/ck", *ARGS)
    assert code == 0, err
    assert len([s for s in seen if s[0] == "tile"]) > 30 and [s for s in seen if s[1]] == []  # no chunk spooled
    fs.invalidate_cache()
    fs.get("native-gcs/ck/", str(tmp_path / "fetched") + "/", recursive=True)
    a, b = ocdbt_items(local_zstd[0]), ocdbt_items(tmp_path / "fetched")
    assert sorted(a) == sorted(b) == ["12/opt_state", "12/params"]
    assert all(a[item] == b[item] for item in a)  # every key and value bitwise
    assert tensors(open_source(str(tmp_path / "fetched"))) == tensors(open_source(str(local_zstd[0])))


def test_an_item_with_databases_both_in_the_bucket_and_in_the_spool_is_refused(s3, tmp_path):
    """Values Orbax's own handlers wrote into the spool's `ocdbt.process_0/` beside arrays
    TensorStore wrote to the bucket: its local manifest, uploaded at the commit, would replace the
    bucket's; the merge refuses the item in one line instead."""
    import asyncio

    from hybridckpt.errors import CheckpointError
    from hybridckpt.io.remote import ts_kvstore, ts_writes, urls
    from hybridckpt.store import stream_orbax

    client(s3).mkdir("mixed")
    item = tmp_path / "12.orbax-checkpoint-tmp" / "params.orbax-checkpoint-tmp"
    (item / "ocdbt.process_0").mkdir(parents=True)
    claimed = []
    r = ts_writes.Redirect(str(tmp_path), urls.parse("s3://mixed/ck"), remote.final_folder, claimed.append)
    ts_writes.redirect(r)
    try:
        spec = ts_writes.to_bucket({"driver": "ocdbt", "base": {"driver": "file", "path": f"{item}/ocdbt.process_0/"}})
        assert spec["base"] == ts_kvstore.kvstore_spec("s3://mixed/ck/12/params/ocdbt.process_0")
        assert claimed == ["12/params/ocdbt.process_0/", "12/params/ocdbt.process_0/d/"]
        kv = ts.KvStore.open(spec).result()
        kv.write("w/.zarray", b"{}").result()
        with pytest.raises(CheckpointError, match=r"s3://mixed/ck/12/params: holds both .* \(ocdbt.process_0\)"):
            asyncio.run(stream_orbax._merge_in_bucket(str(item)))
    finally:
        ts_writes.release(r)
    assert ts_writes.bucket_of(str(item)) is None


def test_what_tensorstore_left_after_a_crash_is_ours_and_replaced_by_overwrite(s3, monkeypatch, tmp_path, capsys):
    """The cleaning fails (the server gone, a kill): TensorStore's objects stay, named by the
    staging marker's folders (listed before TensorStore wrote there), so the next import refuses
    the prefix as unfinished and `--overwrite` replaces it."""
    from hybridckpt.io.remote import urls

    fs = client(s3)
    fs.mkdir("leftover")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(remote.RemoteDestination, "_clean", lambda self: None)
    real = remote.upload_file

    def upload(*a, **k):  # the first upload of the commit: every database is written
        raise ConnectionResetError("connection reset by peer (injected)")

    monkeypatch.setattr(remote, "upload_file", upload)
    refused(cli(capsys, "import", sample_path(), "s3://leftover/ck", *ARGS), "upload failed")
    fs.invalidate_cache()
    left = [p.split("leftover/ck/", 1)[1] for p in fs.find("leftover/ck") if not p.endswith(markers.STAGING)]
    assert any("/d/" in p for p in left) and all(_ocdbt_file(p) for p in left)
    staging = json.loads(fs.cat_file(f"leftover/ck/{markers.STAGING}"))
    assert {p.rsplit("/", 1)[0] + "/" for p in left} <= set(staging["folders"])
    monkeypatch.setattr(remote, "upload_file", real)
    refused(cli(capsys, "import", sample_path(), "s3://leftover/ck", *ARGS), "not finished", "--overwrite")
    assert cli(capsys, "import", sample_path(), "s3://leftover/ck", *ARGS, "--overwrite")[0] == 0
    fs.invalidate_cache()
    markers.check_complete(fs, urls.parse("s3://leftover/ck"))
    marker = json.loads(fs.cat_file(f"leftover/ck/{markers.MARKER}"))
    assert sorted(marker["files"]) == sorted(p.split("leftover/ck/", 1)[1] for p in fs.find("leftover/ck")
                                             if not p.endswith(markers.MARKER))
    assert not set(left) & {p for p in marker["files"] if "/d/" in p}  # the old data files removed


def test_tensorstores_requests_while_writing_are_not_given_to_a_later_read(s3, capsys):
    """What TensorStore asks of the bucket while it writes (manifest reads, conditional writes) is
    set aside when the import ends (`ts_writes.release`): the next `settle` of a read gave it to
    that read's host (CI saw an OCDBT store's read count at 1.4x its bytes, under load)."""
    from hybridckpt.io.remote import ts_kvstore

    fs = client(s3)
    fs.mkdir("aside")
    before = ts_kvstore.requests()["s3"]
    assert cli(capsys, "import", sample_path(), "s3://aside/ck", "--compression", "zstd")[0] == 0
    after = ts_kvstore.requests()["s3"]
    assert after[0] > before[0] and after[1] > before[1]  # TensorStore did read while it wrote
    assert ts_kvstore._seen["s3"] == after  # set aside: nothing left for a later read's settle
