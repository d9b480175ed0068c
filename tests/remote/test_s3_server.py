"""The test S3 server itself: started by the fixture, reachable by s3fs, byte ranges served."""

from __future__ import annotations

import botocore.exceptions
import pytest
import s3fs


def test_server_serves_byte_ranges(s3):
    fs = s3fs.S3FileSystem(anon=False, client_kwargs={"endpoint_url": s3.endpoint})
    fs.mkdir("probe")
    fs.pipe("probe/blob", bytes(range(256)) * 4)
    assert fs.cat_file("probe/blob", start=10, end=20) == bytes(range(10, 20))
    assert fs.size("probe/blob") == 1024


def test_killed_server_refuses(s3_killable):
    fs = s3fs.S3FileSystem(
        anon=False, client_kwargs={"endpoint_url": s3_killable.endpoint}, skip_instance_cache=True
    )
    fs.mkdir("gone")
    s3_killable.kill()
    with pytest.raises((OSError, botocore.exceptions.EndpointConnectionError)):
        fs.pipe("gone/blob", b"x")
