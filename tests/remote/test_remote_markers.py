"""The markers of a remote export are untrusted data (issue 43): a marker that is not ours, not
JSON, too large, or listing names that are not there makes nothing replaceable that it does not
list; a name in it is compared with the listing, never followed. Against a moto server."""

from __future__ import annotations

import json

import pytest
from test_export_s3 import client

from hybridckpt.errors import CheckpointError
from hybridckpt.io.remote import commit as markers
from hybridckpt.io.remote import urls
from hybridckpt.writers.destination import Destination
from hybridckpt.writers.remote import RemoteDestination


def ours(files) -> bytes:
    return markers.body(files, sizes={f: 1 for f in files})


@pytest.fixture
def fs(s3):
    """A client with a bucket of this test's own (`fs.bucket`)."""
    import uuid

    fs = client(s3)
    bucket = f"marks-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    fs.bucket = bucket
    return fs


def test_a_url_destination_is_remote(s3):
    assert isinstance(Destination("s3://any/x", overwrite=True), RemoteDestination)


@pytest.mark.parametrize("marker,replaceable", [
    (ours(["a.bin"]), True),
    (b"not json", False),
    (json.dumps({"written_by": "someone", "files": ["a.bin"]}).encode(), False),
    (json.dumps({"written_by": "hybridckpt", "files": "a.bin"}).encode(), False),
    (json.dumps({"written_by": "hybridckpt", "files": [1]}).encode(), False),
    (ours(["../a.bin", "b.bin"]), False),  # lists names, not this one: a.bin is foreign
])
def test_only_what_our_marker_lists_is_replaceable(fs, marker, replaceable):
    fs.pipe_file(f"{fs.bucket}/p/a.bin", b"x")
    fs.pipe_file(f"{fs.bucket}/p/{markers.MARKER}", marker)
    dest = Destination(f"s3://{fs.bucket}/p", overwrite=True)
    if replaceable:
        dest.preflight()
    else:
        with pytest.raises(CheckpointError, match="not written by hybridckpt"):
            dest.preflight()
    assert fs.cat_file(f"{fs.bucket}/p/a.bin") == b"x"  # (a check never touches anything)


def test_an_oversized_marker_is_not_read(fs, monkeypatch):
    fs.pipe_file(f"{fs.bucket}/big/a.bin", b"x")
    fs.pipe_file(f"{fs.bucket}/big/{markers.MARKER}", ours(["a.bin"]))
    monkeypatch.setattr(markers, "MAX_MARKER_BYTES", 16)
    with pytest.raises(CheckpointError, match="not written by hybridckpt"):
        Destination(f"s3://{fs.bucket}/big", overwrite=True).preflight()


def test_a_staging_marker_makes_the_prefix_incomplete(fs):
    url = urls.parse(f"s3://{fs.bucket}/half")
    fs.pipe_file(f"{fs.bucket}/half/a.bin", b"x")
    markers.check_complete(fs, url)  # (no marker at all: a folder of someone's files, not ours to judge)
    fs.pipe_file(f"{fs.bucket}/half/{markers.STAGING}", markers.body(["a.bin"], job={"id": "j1", "pid": 1}))
    with pytest.raises(CheckpointError, match="not finished writing"):
        markers.check_complete(fs, url)
    with pytest.raises(CheckpointError, match="job j1"):
        Destination(f"s3://{fs.bucket}/half").preflight()
    Destination(f"s3://{fs.bucket}/half", overwrite=True).preflight()  # every object listed: ours


@pytest.mark.parametrize("folders,foreign", [
    (["arr/"], ["arr/sub/0", "other/0"]),  # only the objects directly in a listed folder
    (["arr/", "other/"], ["arr/sub/0"]),
    (["arr"], ["arr/0.0", "arr/1.0", "arr/sub/0", "other/0"]),  # not a folder name: nothing listed
    ("arr/", ["arr/0.0", "arr/1.0", "arr/sub/0", "other/0"]),  # not a list
    ([["arr/"]], ["arr/0.0", "arr/1.0", "arr/sub/0", "other/0"]),
])
def test_a_staging_marker_lists_chunk_folders_and_nothing_more(fs, folders, foreign):
    for name in ("arr/0.0", "arr/1.0", "arr/sub/0", "other/0"):
        fs.pipe_file(f"{fs.bucket}/cut/{name}", b"x")
    staging = json.loads(markers.body([], job={"id": "j2"}))
    staging["folders"] = folders
    fs.pipe_file(f"{fs.bucket}/cut/{markers.STAGING}", json.dumps(staging).encode())
    assert markers.list_prefix(fs, urls.parse(f"s3://{fs.bucket}/cut")).foreign() == foreign


@pytest.mark.parametrize("trees,foreign", [
    (["arr/"], ["other/0"]),  # every object below a listed tree, at any depth (a multi-process import's step)
    (["ar"], ["arr/0.0", "arr/1.0", "arr/sub/0", "other/0"]),  # not a folder name: nothing listed
    (["/"], ["arr/0.0", "arr/1.0", "arr/sub/0", "other/0"]),  # not a folder of the prefix
    ([""], ["arr/0.0", "arr/1.0", "arr/sub/0", "other/0"]),
    ("arr/", ["arr/0.0", "arr/1.0", "arr/sub/0", "other/0"]),  # not a list
])
def test_a_staging_marker_lists_trees_and_nothing_more(fs, trees, foreign):
    for name in ("arr/0.0", "arr/1.0", "arr/sub/0", "other/0"):
        fs.pipe_file(f"{fs.bucket}/tree/{name}", b"x")
    staging = json.loads(markers.body([], job={"id": "j3"}))
    staging["trees"] = trees
    fs.pipe_file(f"{fs.bucket}/tree/{markers.STAGING}", json.dumps(staging).encode())
    assert markers.list_prefix(fs, urls.parse(f"s3://{fs.bucket}/tree")).foreign() == foreign
