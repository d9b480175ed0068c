"""Exports to object storage (issue 43, the write side): `export SRC s3://bucket/prefix` writes the
same bytes as the same export to a local folder, appears complete or not at all (a commit marker
written last; a staging marker written first makes leftovers recognisable), replaces only what
hybridckpt wrote, and streams each file up in bounded parts. Against a moto server on 127.0.0.1.
"""

from __future__ import annotations

import json
import os

import pytest
from fixtures.remote_sources import client, cut_uploads, fresh_bucket

import hybridckpt
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.errors import CheckpointError, ConfigError
from hybridckpt.io.byte_source import close_all
from hybridckpt.io.remote import commit as markers
from hybridckpt.io.remote import urls
from hybridckpt.writers import ownership, remote


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    close_all()
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(result, *must: str) -> str:
    code, _, err = result
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    for m in must:
        assert m in err, (m, err)
    return err


def download(fs, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix` by relative name (one GET each, sent together: `fs.cat` of the
    listing, one hand-off to s3fs's event loop where `cat_file` each took one per object)."""
    fs.invalidate_cache()
    keys = fs.find(prefix)
    return {k[len(prefix) + 1:]: v for k, v in fs.cat(keys).items()} if keys else {}


def listing(fs, prefix: str) -> dict[str, tuple]:
    """Every object under `prefix` by relative name: (size, ETag, LastModified), from one LIST.
    What "nothing touched" compares where every object was downloaded before: the server's ETag
    is the MD5 of what was put (of its parts' MD5s, for a multipart upload), so any changed byte
    changes it; a rewrite with the same bytes a second or more later changes LastModified (a
    download missed that one)."""
    fs.invalidate_cache()
    found = fs.find(prefix, detail=True)
    return {k[len(prefix) + 1:]: (v["size"], v["ETag"], v["LastModified"]) for k, v in found.items()}


def save_files(files: dict[str, bytes], folder) -> None:
    """`files` (relative name -> bytes, as `download` returns them) written below `folder`: the
    objects downloaded once, for a check that reads a folder (`stable_digest`)."""
    for name, data in files.items():
        path = os.path.join(folder, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def local_files(folder) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder).replace(os.sep, "/")] = open(p, "rb").read()
    return out


@pytest.fixture
def bucket(s3):
    return fresh_bucket(s3, "b")


def test_hf_export_to_s3_equals_the_local_export_bitwise(bucket, tmp_path, capsys):
    fs, b = bucket
    local = tmp_path / "hf"
    assert cli(capsys, "export", sample_path(), local, "--to", "hf")[0] == 0
    code, out, err = cli(capsys, "export", sample_path(), f"s3://{b}/out", "--to", "hf")
    assert code == 0, err
    assert f"s3://{b}/out" in out
    assert not os.path.lexists("s3:")  # (nothing written to a local folder named after the URL)
    got, want = download(fs, f"{b}/out"), local_files(local)
    marker = json.loads(got.pop(ownership.MARKER))
    want.pop(ownership.MARKER)
    assert got.keys() == want.keys() and len(want) >= 4
    for name in want:
        assert got[name] == want[name], name
    assert marker["files"] == sorted(want) and marker["sizes"] == {k: len(v) for k, v in sorted(want.items())}
    assert markers.STAGING not in got
    markers.check_complete(fs, urls.parse(f"s3://{b}/out"))  # complete: no error


def test_overwrite_replaces_only_our_prefix(bucket, capsys):
    fs, b = bucket
    dst = f"s3://{b}/out"
    assert cli(capsys, "export", sample_path(), dst, "--to", "dcp")[0] == 0
    before = download(fs, f"{b}/out")
    refused(cli(capsys, "export", sample_path(), dst, "--to", "hf"), "holds an export", "--overwrite")
    assert download(fs, f"{b}/out") == before  # refused: nothing touched
    assert cli(capsys, "export", sample_path(), dst, "--to", "hf", "--overwrite")[0] == 0
    after = download(fs, f"{b}/out")
    assert ".metadata" not in after and "model.safetensors" in after  # the dcp export's objects are gone
    assert sorted(json.loads(after[ownership.MARKER])["files"]) == sorted(set(after) - {ownership.MARKER})
    # a foreign object beside our export: the prefix is no longer ours
    fs.pipe_file(f"{b}/out/notes.txt", b"the user's notes")
    with_notes = download(fs, f"{b}/out")
    refused(cli(capsys, "export", sample_path(), dst, "--overwrite"), "1 object not written by hybridckpt",
            "notes.txt")
    assert download(fs, f"{b}/out") == with_notes
    # a prefix of the user's own files, no marker at all
    fs.pipe_file(f"{b}/mine/a.bin", b"1")
    refused(cli(capsys, "export", sample_path(), f"s3://{b}/mine", "--overwrite"), "not written by hybridckpt",
            "a.bin")
    assert fs.cat_file(f"{b}/mine/a.bin") == b"1"


def test_a_failed_upload_deletes_what_it_wrote(bucket, monkeypatch, capsys):
    fs, b = bucket
    cut_uploads(monkeypatch, 1)
    err = refused(cli(capsys, "export", sample_path(), f"s3://{b}/out"), "upload failed", "nothing committed",
                  "connection reset")
    assert "Traceback" not in err
    assert fs.find(f"{b}/out") == []  # its first object and the staging marker deleted; never a marker


def test_leftovers_of_a_crash_are_ours_refused_by_readers_and_replaced(bucket, tmp_path, monkeypatch, capsys):
    fs, b = bucket
    dst = f"s3://{b}/out"
    real_upload, real_clean = remote.upload_file, remote.RemoteDestination._clean
    cut_uploads(monkeypatch, 2)
    monkeypatch.setattr(remote.RemoteDestination, "_clean", lambda self: None)  # as if killed
    refused(cli(capsys, "export", sample_path(), dst), "upload failed")
    left = download(fs, f"{b}/out")
    assert markers.STAGING in left and ownership.MARKER not in left and len(left) == 3
    staging = json.loads(left[markers.STAGING])
    assert set(left) - {markers.STAGING} <= set(staging["files"])
    with pytest.raises(CheckpointError, match="not finished writing"):
        markers.check_complete(fs, urls.parse(dst))
    monkeypatch.setattr(remote, "upload_file", real_upload)
    monkeypatch.setattr(remote.RemoteDestination, "_clean", real_clean)
    refused(cli(capsys, "export", sample_path(), dst), "has not finished", "--overwrite")
    assert cli(capsys, "export", sample_path(), dst, "--overwrite")[0] == 0
    assert cli(capsys, "export", sample_path(), tmp_path / "hf")[0] == 0
    got, want = download(fs, f"{b}/out"), local_files(tmp_path / "hf")
    got.pop(ownership.MARKER), want.pop(ownership.MARKER)
    assert got == want  # the leftovers replaced, the staging marker gone


def test_the_server_killed_mid_export_ends_in_one_line(s3_killable, monkeypatch, capsys):
    fs = client(s3_killable)
    fs.mkdir("gone")
    uploaded = cut_uploads(monkeypatch, 1, kill=s3_killable)  # after the first object: every later request refused
    refused(cli(capsys, "export", sample_path(), "s3://gone/out"), "s3://gone/out", "upload failed")
    assert len(uploaded) == 1


def test_upload_streams_in_parts_memory_bounded_and_aborts_on_error(bucket, tmp_path):
    fs, b = bucket
    part = 5 << 20  # S3's smallest part
    data = os.urandom(2 * part + 12345)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    held, opened = [], []
    real_open = fs.open

    def counting_open(path, mode="rb", **kw):
        f = real_open(path, mode, **kw)
        opened.append(f)
        real_write = f.write

        def write(chunk):
            held.append(len(chunk))
            n = real_write(chunk)
            held.append(f.buffer.tell() if f.buffer is not None else 0)  # what the backend still holds
            return n

        f.write = write
        return f

    fs.open = counting_open
    assert remote.upload_file(fs, str(src), f"{b}/big.bin", part) == len(data)
    assert fs.cat_file(f"{b}/big.bin") == data
    assert max(held) <= part and len(opened[0].parts) == 3  # three parts, never more than one held
    # a read failing after the first part: the multipart upload is aborted, no object, no open upload

    class Broken:
        def __init__(self):
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, k):
            self.n += 1
            if self.n > 2:
                raise OSError(5, "Input/output error")
            return data[:k]

    import builtins

    real_builtin_open = builtins.open
    builtins.open = lambda p, m="r", *a, **k: Broken() if str(p) == str(src) else real_builtin_open(p, m, *a, **k)
    try:
        with pytest.raises(OSError, match="Input/output"):
            remote.upload_file(fs, str(src), f"{b}/half.bin", part)
    finally:
        builtins.open = real_builtin_open
    assert not fs.exists(f"{b}/half.bin")
    assert fs.call_s3("list_multipart_uploads", Bucket=b).get("Uploads", []) == []


def test_a_store_in_a_bucket_is_one_line_never_a_local_s3_folder(s3, tmp_path, monkeypatch, capsys):
    """CheckpointStore (a training loop's store) refuses a URL in one line; a store written to a
    bucket is never a local folder named `s3:`."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="a CheckpointStore .* lives in a local or mounted folder"):
        hybridckpt.CheckpointStore("s3://bkt/ck")
    import jax.numpy as jnp

    from hybridckpt.store.save import save_checkpoint

    fs = client(s3)
    fs.mkdir("bkt-save")
    assert save_checkpoint("s3://bkt-save/ck", 1, {"w": jnp.ones(4)}) == "s3://bkt-save/ck"
    assert ownership.MARKER in download(fs, "bkt-save/ck")
    assert os.listdir(tmp_path) == []


def test_the_destination_is_never_the_source_url():
    url = urls.parse("s3://b/ckpt")
    for src in ("s3://b/ckpt", "s3://b/ckpt/", "s3://b"):
        with pytest.raises(CheckpointError, match="the destination"):
            remote.check_not_over_sources(url, [src])
    with pytest.raises(CheckpointError, match="holds the source"):
        remote.check_not_over_sources(urls.parse("s3://b"), ["s3://b/ckpt/model.safetensors"])
    remote.check_not_over_sources(url, ["s3://b/ckpt2", "gs://b/ckpt", "/local/ckpt"])


def test_each_shard_goes_up_when_closed_the_spool_holds_one(bucket, monkeypatch):
    fs, b = bucket
    real = remote.upload_file
    spooled = []  # bytes in the spool folder as each object goes up

    def upload(fs_, local, path, part_bytes=None):
        parts = local.split(os.sep)
        spool = os.sep.join(parts[:1 + next(i for i, p in enumerate(parts) if p.startswith("hybridckpt-spool-"))])
        spooled.append(sum(os.path.getsize(os.path.join(r, f)) for r, _, names in os.walk(spool) for f in names))
        return real(fs_, local, path, part_bytes)

    monkeypatch.setattr(remote, "upload_file", upload)
    hybridckpt.export_checkpoint(sample_path(), f"s3://{b}/out", max_shard_bytes=20_000)
    close_all()
    got = download(fs, f"{b}/out")
    shards = [n for n in got if n.startswith("model-") and n.endswith(".safetensors")]
    largest = max(len(got[n]) for n in shards)
    total = sum(len(got[n]) for n in shards)
    assert len(shards) >= 4 and total > 3 * largest
    assert max(spooled) <= largest + 64 * 1024  # one shard (and the small JSON files), never the export
