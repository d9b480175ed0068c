"""An import into a bucket from several processes (issue 43, `writers.remote_shared`): 2 local
processes under `jax.distributed` (the harness of test_multihost_bucket.py: gloo on 127.0.0.1, 4
CPU devices each, a counting proxy per process) import the sample into `s3://` on the local moto
server.

- the store downloaded equals the single-process import into a local folder, every file bit for
  bit (less Orbax's per-process records and device numbering, `digest`), plus the commit marker
  listing every object with its size, and each process's `array_metadatas/process_<i>`;
- each process PUT exactly the chunks its own writers wrote (the files its `io.sequential_file`
  closed, recorded by the worker), each object once, at its own proxy: nothing through process 0;
  only process 0 PUT the markers;
- process 1 killed (SIGKILL) after its second upload: no commit marker; the staging marker stays
  and readers refuse the prefix; the next import with `--overwrite` removes what both processes
  left (the step's folder is listed as ours) and writes the store whole;
- an upload failing on process 1 only: one line on both processes naming the URL and process 1,
  exit 2 on both, nothing left under the prefix (each process deleted what it uploaded, process 0
  the staging marker last);
- a compressed import (`--compression zstd`, OCDBT): each process's TensorStore writes its own
  `ocdbt.process_<i>/` to the bucket (through its own proxy), process 0 merges them there; the
  commit marker lists every object under the prefix; every item database's keys and every
  tensor read back equal the single-process local `--compression zstd` import bit for bit;
- `--overwrite` replaces our own earlier store (refused without it), never a prefix holding an
  object hybridckpt did not write: refused on both processes.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

import pytest
from fixtures.remote_sources import client, fresh_bucket
from test_export_s3 import cli, download, listing, refused, save_files
from test_multihost_bucket import MESH, TWO_PROCESSES, digest, run_pair
from test_store_bucket_native import ocdbt_items
from test_tensorstore_from_bucket import tensors

from hybridckpt.demo import sample_path
from hybridckpt.formats.registry import open_source
from hybridckpt.io.remote import commit as markers
from hybridckpt.writers import ownership


@pytest.fixture
def bucket(s3):
    return fresh_bucket(s3, "mp")


def _import(url: str, *extra: str) -> list[str]:
    return ["import", sample_path(), url, "--mesh", MESH, *extra]


def _puts(requests, bucket: str, prefix: str = "ck") -> list[str]:
    """The object names below `bucket`/`prefix`/ a proxy saw PUT (one request per object here:
    every object is under s3fs's multipart part size)."""
    base = f"/{bucket}/{prefix}/"
    return [unquote(r.path[len(base):]) for r in requests if r.method == "PUT" and r.path.startswith(base)]


@TWO_PROCESSES
def test_two_processes_import_into_a_bucket_each_uploading_its_own_chunks(s3, bucket, tmp_path, capsys):
    """(one pair of processes for six imports: the second, into ck2, has process 1's fourth
    upload fail; the third, compressed, into ck3; then ck again: refused, then --overwrite;
    then --overwrite over a prefix holding a user's object: refused)"""
    fs, b = bucket
    url = f"s3://{b}/ck"
    fs.pipe_file(f"{b}/mine/notes.txt", b"the user's")
    commands = [_import(url, "--json"), _import(url + "2"), _import(url + "3", "--compression", "zstd"),
                _import(url), _import(url, "--overwrite"), _import(f"s3://{b}/mine", "--overwrite")]
    rcs, logs, results, seen, _ = run_pair(tmp_path, s3, lambda pid: commands,
                                           faults=({}, {"fail_after_uploads": 3, "fail_command": 1}))
    assert rcs == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert [r["results"][0]["rc"] for r in results] == [0, 0], [r["results"][0]["stderr"] for r in results]
    assert [json.loads(r["results"][0]["stdout"])["destination"] for r in results] == [url, url]
    got = download(fs, f"{b}/ck")  # (the fifth import's, over the first's: the same objects)
    save_files(got, tmp_path / "fetched")  # (for the bitwise check below: downloaded once)
    marker = json.loads(got.pop(ownership.MARKER))
    assert markers.STAGING not in got
    assert marker["files"] == sorted(got) and marker["sizes"] == {k: len(v) for k, v in sorted(got.items())}
    # each process's own writers' files went up from that process, each object once
    puts = [_puts(seen[p][0], b) for p in range(2)]
    closed = [set(r["results"][0]["closed"]) for r in results]
    chunks = [set(p) & (closed[0] | closed[1]) for p in puts]
    assert chunks == closed and all(len(c) > 10 for c in closed), [len(c) for c in closed]
    assert not closed[0] & closed[1]
    objects = [n for n in puts[0] + puts[1] if n not in (ownership.MARKER, markers.STAGING)]
    assert len(objects) == len(set(objects))  # none twice
    assert markers.STAGING not in puts[1] and ownership.MARKER not in puts[1]
    assert set(puts[0]) | set(puts[1]) == set(got) | {ownership.MARKER, markers.STAGING}
    records = {n for n in got if n.endswith("/array_metadatas/process_1")}  # (process 1's own Orbax record)
    assert set(puts[1]) - closed[1] == records and len(records) == 2
    # bit for bit the single-process import into a local folder
    assert cli(capsys, "import", sample_path(), tmp_path / "local", "--mesh", MESH)[0] == 0
    a, c = digest(tmp_path / "local"), digest(tmp_path / "fetched")
    c.pop(ownership.MARKER)
    assert sorted(a) == sorted(c) and len(a) > 5
    assert [k for k in a if a[k] != c[k]] == []
    assert cli(capsys, "verify", url)[0] == 0
    # an upload failing on process 1 only: one line on both, naming the URL and process 1, exit 2,
    # nothing left under the prefix (each process deleted what it uploaded, process 0 the staging
    # marker last)
    for r in results:
        out = r["results"][1]
        assert out["rc"] == 2, out
        assert out["stderr"].count("\n") == 1 and out["stderr"].startswith("hybridckpt: error:"), out["stderr"]
        assert url + "2" in out["stderr"] and "process 1" in out["stderr"], out["stderr"]
        assert "nothing committed" in out["stderr"] and "injected" in out["stderr"], out["stderr"]
    assert len(_puts(seen[1][1], b, "ck2")) == 3  # process 1 did upload before it failed
    assert len(_puts(seen[0][1], b, "ck2")) > 3  # and so did process 0
    # our own store in the bucket: refused without --overwrite on both processes, replaced with it
    # (process 1 again uploading only its own writers' chunks); a prefix holding a user's object
    # refused on both, even with --overwrite, the object untouched
    for p, r in enumerate(results):
        again, over, mine = r["results"][3], r["results"][4], r["results"][5]
        assert again["rc"] == 2 and again["stderr"].count("\n") == 1, again
        assert url in again["stderr"] and "holds an export" in again["stderr"] and "--overwrite" in again["stderr"]
        assert _puts(seen[p][3], b) == []
        assert over["rc"] == 0, over["stderr"]
        assert mine["rc"] == 2 and mine["stderr"].count("\n") == 1, mine
        assert "not written by hybridckpt" in mine["stderr"] and "notes.txt" in mine["stderr"], mine["stderr"]
    assert set(_puts(seen[1][4], b)) - set(results[1]["results"][4]["closed"]) == records
    assert download(fs, f"{b}/mine") == {"notes.txt": b"the user's"}
    assert client(s3).find(f"{b}/ck2") == []
    # a compressed import (OCDBT): each process's TensorStore wrote its own sub-database to the bucket,
    # process 0 merged them there; every object listed; equal to the local single-process import
    assert [r["results"][2]["rc"] for r in results] == [0, 0], [r["results"][2]["stderr"] for r in results]
    written = [{n.split("/")[2] for n in _puts(seen[p][2], b, "ck3") if n.count("/") > 2} for p in range(2)]
    assert "ocdbt.process_1" in written[1] and "ocdbt.process_0" not in written[1], written
    assert "ocdbt.process_0" in written[0] and "ocdbt.process_1" not in written[0], written
    zipped = download(fs, f"{b}/ck3")
    save_files(zipped, tmp_path / "fetchedz")
    marker = json.loads(zipped.pop(ownership.MARKER))
    assert markers.STAGING not in zipped
    assert marker["files"] == sorted(zipped) and marker["sizes"] == {k: len(v) for k, v in sorted(zipped.items())}
    assert any("/ocdbt.process_1/d/" in n for n in zipped) and any("/ocdbt.process_0/d/" in n for n in zipped)
    assert cli(capsys, "import", sample_path(), tmp_path / "localz", "--mesh", MESH, "--compression", "zstd")[0] == 0
    want, got = ocdbt_items(tmp_path / "localz"), ocdbt_items(tmp_path / "fetchedz")
    assert sorted(want) == sorted(got) and len(want) == 2
    for item in want:  # every key of every item's database (`.zarray`s, zstd chunks) bitwise
        assert sorted(want[item]) == sorted(got[item]) and len(want[item]) > 10
        assert [k for k in want[item] if want[item][k] != got[item][k]] == []
    assert tensors(open_source(str(tmp_path / "fetchedz"))) == tensors(open_source(str(tmp_path / "localz")))


@TWO_PROCESSES
def test_a_process_killed_mid_upload_leaves_no_commit_marker(s3, bucket, tmp_path, capsys):
    fs, b = bucket
    url = f"s3://{b}/ck"
    rcs, logs, results, _, _ = run_pair(tmp_path, s3, lambda pid: [_import(url)],
                                        faults=({}, {"kill_after_uploads": 2}), heartbeat_s=5)
    assert rcs[1] == -9, logs[1][-2000:]
    assert rcs[0] != 0, logs[0][-2000:]
    left = download(fs, f"{b}/ck")
    assert ownership.MARKER not in left and markers.STAGING in left
    # process 1's two uploads at least (process 0 deletes its own when its collective gives up, if
    # JAX lets it: it may be aborted first); the staging marker's step folder names them ours
    trees = json.loads(left.pop(markers.STAGING))["trees"]
    assert len(trees) == 1 and len(left) >= 2 and all(n.startswith(trees[0]) for n in left), (trees, sorted(left))
    refused(cli(capsys, "inspect", url), url, "not finished")
    refused(cli(capsys, "import", sample_path(), url, "--mesh", MESH), url, "--overwrite")
    assert cli(capsys, "import", sample_path(), url, "--mesh", MESH, "--overwrite")[0] == 0
    after = listing(fs, f"{b}/ck")
    marker = json.loads(fs.cat_file(f"{b}/ck/{ownership.MARKER}"))
    assert sorted(marker["files"]) == sorted(set(after) - {ownership.MARKER})
    assert cli(capsys, "verify", url)[0] == 0
