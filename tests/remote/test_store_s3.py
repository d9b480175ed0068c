"""Our own store in a bucket (issue 43): `hybridckpt import SRC s3://bucket/ck` writes the store
into a local spool exactly as a local import does and uploads it with the export's markers
(`writers.remote`); downloaded, it equals the local import bit for bit. A failure or a server
killed mid-upload leaves no commit marker, and readers refuse the prefix.
"""

from __future__ import annotations

import json

import pytest
from fixtures.remote_sources import cut_uploads, fresh_bucket
from meshes import fit
from test_export_s3 import cli, client, download, listing, refused, save_files
from test_remote_import import stable_digest

from hybridckpt.demo import sample_path
from hybridckpt.io.remote import commit as markers
from hybridckpt.io.remote import urls
from hybridckpt.writers import ownership


@pytest.fixture
def bucket(s3):
    return fresh_bucket(s3, "st")


def test_import_to_s3_equals_the_local_import_bitwise(bucket, tmp_path, capsys):
    fs, b = bucket
    dst = f"s3://{b}/ck"
    assert cli(capsys, "import", sample_path(), tmp_path / "local", "--mesh", fit("fsdp=2,tp=2"))[0] == 0
    code, out, err = cli(capsys, "import", sample_path(), dst, "--mesh", fit("fsdp=2,tp=2"), "--json")
    assert code == 0, err
    assert json.loads(out)["destination"] == dst
    got = download(fs, f"{b}/ck")
    marker = json.loads(got.pop(ownership.MARKER))
    assert markers.STAGING not in got
    assert marker["files"] == sorted(got) and marker["sizes"] == {k: len(v) for k, v in sorted(got.items())}
    markers.check_complete(fs, urls.parse(dst))
    save_files(got, tmp_path / "fetched")  # (the objects downloaded above, once)
    fetched = stable_digest(tmp_path / "fetched")
    want = stable_digest(tmp_path / "local")
    assert sorted(fetched) == sorted(want) and len(want) > 5
    assert [k for k in want if fetched[k] != want[k]] == []  # bitwise, every file


def test_overwrite_only_over_a_store_of_ours(bucket, capsys):
    fs, b = bucket
    dst = f"s3://{b}/ck"
    assert cli(capsys, "import", sample_path(), dst)[0] == 0
    before = listing(fs, f"{b}/ck")  # (each object's size, ETag and time: nothing touched, without a download)
    refused(cli(capsys, "import", sample_path(), dst), "holds an export", "--overwrite")
    assert listing(fs, f"{b}/ck") == before and len(before) > 5
    assert cli(capsys, "import", sample_path(), dst, "--overwrite", "--mesh", fit("fsdp=2"))[0] == 0
    after = listing(fs, f"{b}/ck")
    marker = json.loads(fs.cat_file(f"{b}/ck/{ownership.MARKER}"))
    assert sorted(marker["files"]) == sorted(set(after) - {ownership.MARKER})
    fs.pipe_file(f"{b}/mine/notes.txt", b"the user's")
    refused(cli(capsys, "import", sample_path(), f"s3://{b}/mine", "--overwrite"), "not written by hybridckpt",
            "notes.txt")
    assert download(fs, f"{b}/mine") == {"notes.txt": b"the user's"}


def test_a_failed_upload_of_the_store_deletes_what_it_wrote(bucket, monkeypatch, capsys):
    fs, b = bucket
    went_up = cut_uploads(monkeypatch, 3)
    refused(cli(capsys, "import", sample_path(), f"s3://{b}/ck"), "upload failed", "nothing committed")
    assert len(went_up) == 3  # the fourth refused
    assert fs.find(f"{b}/ck") == []  # what went up deleted, the staging marker last; never a commit marker


def test_the_server_killed_mid_store_upload_leaves_no_commit_marker(s3_killable, monkeypatch, capsys):
    fs = client(s3_killable)
    fs.mkdir("gone")
    uploaded = cut_uploads(monkeypatch, 2, kill=s3_killable)  # every later request refused: no cleaning, no marker
    refused(cli(capsys, "import", sample_path(), "s3://gone/ck"), "s3://gone/ck", "upload failed")
    assert len(uploaded) == 2
