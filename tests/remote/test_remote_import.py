"""Sources in a bucket (issue 43, the read side): an HF sharded folder written by transformers and
a DCP written by torch FSDP2, served by a local S3 server (moto), read by byte ranges only.

`hybridckpt import s3://bucket/src ckpt` equals the same import from the local folder bit for
bit (every file of the two checkpoints); `inspect` and `verify` see the same; the requests and
bytes each import asked the server for are counted on our side of the client
(`io.byte_source.count_reads`, `(host, "requests")` / `(host, "requested")`) and bounded by the
bytes the devices needed; no data file is ever fetched whole.
"""

from __future__ import annotations

import json
import os

import pytest
from attacks.hostile import tree_digest
from fixtures import remote_sources
from meshes import cases

from hybridckpt.cli import main
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import remote_requests, tally


def stable_digest(root) -> dict[str, bytes]:
    """`tree_digest` less what differs between any two imports of one source: Orbax's commit
    notes (they name the temporary folder), its metadata's timestamps, the source's path."""
    out = {}
    for rel, data in tree_digest(str(root)).items():
        name = os.path.basename(rel)
        if name == "commit_success.txt":
            continue
        if name == "_CHECKPOINT_METADATA":
            meta = json.loads(data)
            data = json.dumps({k: v for k, v in meta.items() if "timestamp" not in k}, sort_keys=True).encode()
        if rel.endswith("trainer_state/metadata"):  # the source's path (a URL from the bucket) is recorded
            state = json.loads(data)
            state["source"]["path"] = "SRC"
            data = json.dumps(state, sort_keys=True).encode()
        out[rel] = data
    return out


@pytest.mark.parametrize("name,mesh", cases([("hf", "fsdp=2,tp=2"), ("dcp", "fsdp=4,tp=2")]))
def test_import_from_bucket_equals_import_from_disk(s3, local_sources, tmp_path, capsys, name, mesh):
    local = local_sources[name]
    url = remote_sources.in_bucket(s3, local)
    assert main(["import", local, str(tmp_path / "from_disk"), "--mesh", mesh]) == 0
    capsys.readouterr()
    with count_reads() as reads:
        assert main(["import", url, str(tmp_path / "from_bucket"), "--mesh", mesh, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    a, b = stable_digest(tmp_path / "from_disk"), stable_digest(tmp_path / "from_bucket")
    assert sorted(a) == sorted(b) and len(a) > 3
    assert [k for k in a if a[k] != b[k]] == []  # bitwise, every file

    needed, _, _, _ = tally(reads)  # the bytes the readers asked for
    hosts = remote_requests(reads)
    assert list(hosts) == [f"127.0.0.1:{s3.port}"]
    got = hosts[f"127.0.0.1:{s3.port}"]
    data = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local)
               if f.endswith((".safetensors", ".distcp")))
    assert 0 < got["bytes"] <= 1.1 * needed, (got, needed)
    assert got["bytes"] <= 1.1 * data  # never a file twice over
    assert got["requests"] < 200, got
    assert summary["source"] == url
    host = f"127.0.0.1:{s3.port}"
    metadata = [f for f in os.listdir(local) if not f.endswith((".safetensors", ".distcp"))]
    shards = [f for f in os.listdir(local) if f.endswith((".safetensors", ".distcp"))]
    assert summary["requests"] == {host: {  # the ranged GETs, one LIST, a GET per metadata file, a HEAD per shard
        "requests": got["requests"] + 1 + len(metadata) + len(shards),
        "bytes": got["bytes"] + sum(os.path.getsize(os.path.join(local, f)) for f in metadata)}}
