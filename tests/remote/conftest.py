"""Fixtures for the object-storage tests: an S3-compatible server started and stopped here."""

from __future__ import annotations

import pytest
from fixtures import remote_sources, s3_server


@pytest.fixture(scope="session")
def s3_shared():
    """One moto server for the session (tests that do not kill it)."""
    server = s3_server.start()
    yield server
    server.kill()


@pytest.fixture
def s3(s3_shared, monkeypatch):
    """The session's server, with this test's environment pointing S3 clients at it."""
    s3_server.apply_env(monkeypatch, s3_shared)
    return s3_shared


@pytest.fixture
def s3_killable(monkeypatch):
    """A server of this test's own, which the test may kill mid-transfer."""
    server = s3_server.start()
    s3_server.apply_env(monkeypatch, server)
    yield server
    server.kill()


@pytest.fixture(scope="session")
def gcs_shared():
    """One GCS emulator for the session (tests that do not kill it)."""
    from fixtures import gcs_server

    server = gcs_server.start()
    yield server
    server.kill()


@pytest.fixture
def gcs(gcs_shared, monkeypatch):
    """The session's GCS emulator, with this test's environment pointing GCS clients at it."""
    from fixtures import gcs_server

    gcs_server.apply_env(monkeypatch, gcs_shared)
    return gcs_shared


@pytest.fixture(scope="session")
def local_sources(tmp_path_factory):
    """name -> a local folder written by the real tool: "hf" (transformers, sharded), "dcp" (torch FSDP2)."""
    return {
        "hf": remote_sources.hf_sharded(str(tmp_path_factory.mktemp("hf"))),
        "dcp": remote_sources.dcp_fsdp2(str(tmp_path_factory.mktemp("dcp"))),
    }
