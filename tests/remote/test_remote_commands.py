"""inspect, verify and --plan of a source in a bucket (issue 43, the read side), against the same
commands on the local folder; the server killed mid-import; hostile bucket names; what a view
refuses (a file read whole, a metadata object past the bound)."""

from __future__ import annotations

import json
import os

import boto3
import pytest
from fixtures import remote_sources
from meshes import fit

from hybridckpt.cli import main
from hybridckpt.errors import FormatError
from hybridckpt.io.regular_file import open_regular
from hybridckpt.io.remote import ranged, view


def _json(capsys, argv) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridckpt: error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("name", ["hf", "dcp"])
def test_inspect_and_verify_from_bucket(s3, local_sources, tmp_path, capsys, name):
    local = local_sources[name]
    url = remote_sources.in_bucket(s3, local)
    here, there = _json(capsys, ["inspect", local, "--json"]), _json(capsys, ["inspect", url, "--json"])
    assert there.pop("path") == url and here.pop("path") == local
    assert here == there and len(here["tensors"]) > 10
    capsys.readouterr()
    assert main(["verify", url, local]) == 0  # every param and optimizer slot bitwise
    out = capsys.readouterr().out
    assert "BAD" not in out and " ok " in f" {out}"


def test_plan_reports_requests_per_host(s3, local_sources, capsys):
    local = local_sources["hf"]
    url = remote_sources.in_bucket(s3, local)
    mesh = ["--mesh", fit("fsdp=2,tp=2")]
    here = _json(capsys, ["import", local, "unused", "--plan", "--json", *mesh])
    there = _json(capsys, ["import", url, "unused", "--plan", "--json", *mesh])
    host = f"127.0.0.1:{s3.port}"
    assert all(p["requests"] == {} for p in here["processes"])  # a local source: no requests
    for d in there["devices"]:
        asked = d["requests"][host]
        assert 0 < asked["requests"] <= d["reads"] and asked["bytes"] >= d["bytes_read"] > 0
        assert all(f.startswith(url + "/") for f in d["files"])
    assert there["processes"][0]["requests"][host]["requests"] == sum(d["requests"][host]["requests"] for d in there["devices"])
    assert [d["bytes_read"] for d in there["devices"]] == [d["bytes_read"] for d in here["devices"]]
    text = capsys.readouterr() and main(["import", url, "unused", "--plan", *mesh])
    assert text == 0 and f"from {host}: " in capsys.readouterr().out


def test_server_killed_mid_import_one_line_nothing_committed(s3_killable, local_sources, tmp_path, capsys, monkeypatch):
    url = remote_sources.in_bucket(s3_killable, local_sources["dcp"])
    real_get, calls = ranged.get, []

    def get_then_cut(obj, start, end):
        calls.append((start, end))
        if len(calls) == 5:  # a few ranges in: the server dies
            s3_killable.kill()
        return real_get(obj, start, end)

    monkeypatch.setattr(ranged, "get", get_then_cut)
    monkeypatch.setattr(ranged, "BACKOFF_S", 0.01)
    out = tmp_path / "out"
    err = _error(capsys, ["import", url, str(out), "--mesh", fit("fsdp=2")])
    assert url in err and "failed after 4 tries" in err and "bytes [" in err
    assert len(calls) >= 5
    assert os.listdir(tmp_path) == []  # nothing committed, nothing left beside it


def _put(server, bucket: str, objects: dict[str, bytes]) -> None:
    c = boto3.client("s3", endpoint_url=server.endpoint)
    c.create_bucket(Bucket=bucket)
    for key, data in objects.items():
        c.put_object(Bucket=bucket, Key=key, Body=data)


@pytest.mark.parametrize("key", ["p/../escaped.json", "p/a\\b.json", "p/a//b.json", "p/./c.json"])
def test_hostile_object_names_refused(s3, capsys, key):
    bucket = f"hostile{abs(hash(key)) % 10**8}"
    _put(s3, bucket, {"p/config.json": b"{}", key: b"{}"})
    err = _error(capsys, ["inspect", f"s3://{bucket}/p"])
    assert f"s3://{bucket}/p" in err and "only a path inside the checkpoint folder is read" in err


def test_placeholder_never_read_whole_and_metadata_bound(s3, local_sources, capsys, monkeypatch):
    url = remote_sources.in_bucket(s3, local_sources["hf"])
    root = view.local_path(url)
    shard = next(f for f in sorted(os.listdir(root)) if f.endswith(".safetensors"))
    with pytest.raises(FormatError, match="byte ranges only"):  # a placeholder holds no byte: never zeros
        open_regular(os.path.join(root, shard))
    assert not any(open(os.path.join(root, shard), "rb").read())  # (what a bare open would see)
    monkeypatch.setattr(view, "MAX_METADATA_BYTES", 100)  # config.json is over it: left in the bucket
    url = remote_sources.in_bucket(s3, local_sources["hf"])
    err = _error(capsys, ["inspect", url])
    assert f"{url}/" in err and ".json: " in err and "more than the 100 bytes a metadata file" in err


def test_plan_ranges_coalesces_and_cuts():
    assert ranged.plan_ranges([(100, 200), (0, 50), (250, 260)], gap=50, part=1000) == [(0, 260)]
    assert ranged.plan_ranges([(0, 10), (100, 110)], gap=50, part=1000) == [(0, 10), (100, 110)]
    assert ranged.plan_ranges([(0, 25)], gap=0, part=10) == [(0, 10), (10, 20), (20, 25)]
    assert ranged.plan_ranges([(5, 5)]) == []


def test_export_and_logits_from_bucket(s3, local_sources, tmp_path, capsys):
    import numpy as np
    from attacks.hostile import tree_digest

    local = local_sources["hf"]
    url = remote_sources.in_bucket(s3, local)
    assert main(["export", local, str(tmp_path / "here")]) == 0
    assert main(["export", url, str(tmp_path / "there")]) == 0
    here, there = tree_digest(str(tmp_path / "here")), tree_digest(str(tmp_path / "there"))
    assert sorted(here) == sorted(there) and any(k.endswith(".safetensors") for k in here)
    assert [k for k in here if k.endswith((".safetensors", ".json")) and here[k] != there[k]
            and k != ".hybridckpt-export"] == []
    for src, out in ((local, "a.npy"), (url, "b.npy")):
        assert main(["logits", src, "--tokens", "1,5,9,200", "--out", str(tmp_path / out)]) == 0
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert a.shape[-1] == 256 and np.array_equal(a, b)


class _Flaky:
    """An fsspec filesystem stand-in whose first `fail` ranged reads raise a connection error."""

    def __init__(self, data: bytes, fail: int):
        self.data, self.fail, self.calls = data, fail, 0

    def cat_file(self, key, start, end):
        self.calls += 1
        if self.calls <= self.fail:
            raise ConnectionResetError("connection reset by peer")
        return self.data[start:end]


def test_transient_errors_retried_then_one_line(monkeypatch):
    from hybridckpt.errors import CheckpointError
    from hybridckpt.io.remote.urls import parse

    monkeypatch.setattr(ranged, "BACKOFF_S", 0.0)
    data = bytes(range(256)) * 8
    fs = _Flaky(data, fail=ranged.TRIES - 1)
    obj = ranged.RemoteObject(parse("s3://b/flaky-ok"), fs, len(data), "h")
    assert ranged.get(obj, 100, 300) == data[100:300] and fs.calls == ranged.TRIES
    fs = _Flaky(data, fail=ranged.TRIES)
    obj = ranged.RemoteObject(parse("s3://b/flaky-bad"), fs, len(data), "h")
    with pytest.raises(CheckpointError, match=r"s3://b/flaky-bad: reading bytes \[100, 300\) failed after 4 tries: "
                                              r"ConnectionResetError: connection reset by peer"):
        ranged.get(obj, 100, 300)
    with pytest.raises(FormatError, match="outside the object's 2048 bytes"):  # checked before any request
        ranged.read_ranges(obj, [(2000, 2100)], lambda *_: None)


def test_object_rewritten_mid_import_not_committed(s3, local_sources, tmp_path, capsys, monkeypatch):
    import s3fs

    url = remote_sources.in_bucket(s3, local_sources["hf"])
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3.endpoint}, skip_instance_cache=True)
    real_get, done = ranged.get, []

    def get_then_rewrite(obj, start, end):
        data = real_get(obj, start, end)
        if not done and obj.key.endswith(".safetensors"):  # the same size, other bytes: only the ETag tells
            done.append(obj.key)
            old = fs.cat_file(obj.key)
            fs.pipe_file(obj.key, old[:-1] + bytes([old[-1] ^ 0xFF]))
        return data

    monkeypatch.setattr(ranged, "get", get_then_rewrite)
    err = _error(capsys, ["import", url, str(tmp_path / "out")])
    assert f"s3://{done[0]} changed while it was read: rewritten at the same size" in err and "ETag" in err
    assert os.listdir(tmp_path) == []


def test_prefix_of_too_many_objects_refused(s3, capsys, monkeypatch):
    _put(s3, "crowded", {f"p/f{i}.json": b"{}" for i in range(4)})
    monkeypatch.setattr(view, "MAX_OBJECTS", 3)
    err = _error(capsys, ["inspect", "s3://crowded/p"])
    assert "s3://crowded/p: 4 objects below the prefix, more than the 3 a source may hold" in err
    assert _error(capsys, ["inspect", "s3://crowded/nothing"]).endswith("s3://crowded/nothing: no objects there (nothing to read)")
