"""Which SRC/DST strings are object storage, and the one-line refusals around them."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridckpt.errors import ConfigError
from hybridckpt.io.remote import urls


@pytest.mark.parametrize(
    "text, expected",
    [
        ("s3://bucket/a/b", ("s3", "bucket/a/b")),
        ("s3://bucket/a/b/", ("s3", "bucket/a/b")),
        ("gs://b", ("gs", "b")),
        ("memory://x/y", ("memory", "x/y")),
    ],
)
def test_urls_parse(text, expected):
    url = urls.parse(text)
    assert (url.scheme, url.path) == expected
    assert urls.is_remote(text)
    assert str(url) == f"{expected[0]}://{expected[1]}"


@pytest.mark.parametrize("text", ["ckpt", "./s3:/x", "/abs/path", "file:///tmp/x", "", Path("s3x")])
def test_local_paths_are_not_urls(text):
    assert urls.parse(text) is None


@pytest.mark.parametrize("text", ["s3://", "s3:///x", "gs:////"])
def test_url_without_bucket_is_one_line(text):
    with pytest.raises(ConfigError, match="needs a bucket"):
        urls.parse(text)


def test_endpoint_from_environment(s3):
    fs = urls.filesystem(urls.parse("s3://probe-urls/x"))
    fs.mkdir("probe-urls")
    fs.pipe("probe-urls/x", b"abc")
    assert fs.cat_file("probe-urls/x") == b"abc"


def test_unknown_scheme_is_one_line():
    with pytest.raises(ConfigError, match="no fsspec backend"):
        urls.filesystem(urls.parse("nosuchscheme://b/x"))


def test_gcs_emulator_serves_byte_ranges(gcs):
    fs = urls.filesystem(urls.parse("gs://probe-gcs/x"))
    fs.mkdir("probe-gcs")
    fs.pipe("probe-gcs/x", bytes(range(256)) * 4)
    assert fs.cat_file("probe-gcs/x", start=10, end=20) == bytes(range(10, 20))
    assert fs.size("probe-gcs/x") == 1024


def test_our_store_in_a_bucket_is_one_line_never_a_local_folder(tmp_path, monkeypatch):
    """CheckpointStore refuses a URL in one line (a training loop's store lives in a folder) and
    leaves no folder named `s3:` behind (restore from a bucket: tests/remote/test_store_s3_read.py)."""
    import hybridckpt

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="lives in a local or mounted folder"):
        hybridckpt.CheckpointStore("s3://bucket/ckpt")
    assert list(tmp_path.iterdir()) == []
