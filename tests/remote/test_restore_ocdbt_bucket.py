"""`restore()` of our store in a bucket where Orbax would read it (issue 43): an OCDBT item (a store
imported with `--compression zstd`: one OCDBT database of zstd chunks per item, the layout of a
training loop's save too) and a restore with `verify_reads=False`. Orbax builds its TensorStore
specs from the folder's path, the local view's placeholders; our reader reads instead
(`store.bucket_restore`): the item's metadata and chunks from the bucket by byte ranges. Counted at
the server by a proxy in front of it (`fixtures.counting_proxy`): every restored array equals the
local restore bit for bit, the bytes sent stay within 1.1x the chunks' bytes, and what is not
needed (the optimizer state when it is not restored) is not fetched at all; a damaged chunk and
a server killed mid-restore are one line naming the URL; the job's counters and an import's
summary hold every GET and byte TensorStore made.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from fixtures import s3_server
from fixtures.counting_proxy import CountingProxy
from meshes import fit, fit_pair
from test_export_s3 import client

import hybridckpt
from hybridckpt.containers.orbax.chunk_index import read_index
from hybridckpt.errors import CheckpointError
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import remote_requests
from hybridckpt.io.remote import ranged, view

BUCKET = "ocdbt-restore"
SAVED, TARGET = fit_pair("fsdp=2", "fsdp=4,tp=2")  # a reshard down to 2 devices (1: dp=1 both)


@pytest.fixture(scope="module")
def zstd_store(s3_shared, local_sources, tmp_path_factory):
    """(local folder, URL): torch FSDP2's DCP save (params and AdamW moments) imported with
    --compression zstd to disk, and the same import to the bucket."""
    with pytest.MonkeyPatch.context() as mp:
        s3_server.apply_env(mp, s3_shared)
        client(s3_shared).mkdir(BUCKET)
        local = tmp_path_factory.mktemp("zstd") / "ck"
        for dst in (local, f"s3://{BUCKET}/zstd"):
            assert hybridckpt.cli.main(["import", local_sources["dcp"], str(dst), "--compression", "zstd",
                                        "--mesh", SAVED]) == 0
    step = os.listdir(local)
    assert os.path.isfile(local / step[0] / "params" / "manifest.ocdbt")  # an OCDBT item
    return local / step[0], f"s3://{BUCKET}/zstd"


@pytest.fixture
def proxy(s3, monkeypatch):
    """A counting proxy in front of the server, the clients pointed at it (a view of its own)."""
    p = CountingProxy(s3.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.endpoint)
    yield p
    p.close()


def leaves(tree) -> dict[str, bytes]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(k): str(np.asarray(v).dtype).encode() + np.asarray(v).tobytes() for k, v in flat}


def chunk_bytes(item_dir) -> int:
    """Bytes of the chunk values the item's OCDBT index holds (by reference or inline)."""
    index = read_index(str(item_dir))
    return sum(loc.length for k, loc in index.locations.items() if not k.endswith("/.zarray")) + \
        sum(len(v) for v in index.inline.values())


def data_gets(requests, prefix: str) -> list:
    """The GETs of OCDBT data files (`.../d/<name>`) below `prefix` (`/bucket/key...`)."""
    return [r for r in requests if r.method == "GET" and r.path.startswith(prefix) and "/d/" in r.path]


def counted(reads, proxy) -> dict[str, int]:
    """What the job's counters recorded for the proxy's host (`io.read_tally.remote_requests`)."""
    return remote_requests(reads)[proxy.endpoint.split("://", 1)[1]]


@pytest.mark.parametrize("verify_reads", [True, False])
def test_restore_of_an_ocdbt_store_from_s3_equals_the_local_restore(zstd_store, proxy, verify_reads):
    local, url = zstd_store
    _, want = hybridckpt.restore(str(local.parent), TARGET, verify_reads=verify_reads)
    with count_reads() as reads:
        _, got = hybridckpt.restore(url, TARGET, verify_reads=verify_reads)  # another mesh than saved
    a, b = leaves((want.params, want.opt_state)), leaves((got.params, got.opt_state))
    assert sorted(a) == sorted(b) and len(a) > 20
    assert [k for k in a if a[k] != b[k]] == []  # bitwise, params and AdamW moments
    q, q0 = got.params["layers"]["q"]["kernel"], want.params["layers"]["q"]["kernel"]
    assert q.sharding == q0.sharding and got.topology == want.topology
    sent = data_gets(proxy.snapshot(), f"/{BUCKET}/zstd/")
    needed = sum(chunk_bytes(local / item) for item in ("params", "opt_state"))
    assert sent and all(r.range for r in sent)  # the data files by byte ranges only
    assert needed <= sum(r.body_bytes for r in sent) <= 1.1 * needed  # each chunk once, plus the B-tree nodes
    mine = counted(reads, proxy)  # TensorStore's GETs counted for the host, as the server saw them
    assert mine["requests"] >= len(sent) and mine["bytes"] >= sum(r.body_bytes for r in sent)


def test_a_chunk_two_devices_share_is_fetched_once_when_their_reads_do_not_overlap(zstd_store, proxy, monkeypatch):
    """One reader thread: the devices' boxes are read one after the other, so a stored chunk two
    of them share (saved on fsdp=2, restored onto fsdp=4,tp=2; on 1 device none is shared) is asked for again after the first
    read has ended. TensorStore's default cache pool holds nothing, so each box fetched it anew
    (2x the chunks' bytes; with 4 threads only when the reads happened not to overlap, as on a
    loaded machine); the decoded-chunk cache of `ts_spec.context` serves the second box."""
    from hybridckpt.lazy import parallel

    local, url = zstd_store
    monkeypatch.setattr(parallel, "_override", 1)
    _, got = hybridckpt.restore(url, TARGET, verify_reads=False)
    _, want = hybridckpt.restore(str(local.parent), TARGET, verify_reads=False)
    assert leaves((got.params, got.opt_state)) == leaves((want.params, want.opt_state))
    sent = data_gets(proxy.snapshot(), f"/{BUCKET}/zstd/")
    needed = sum(chunk_bytes(local / item) for item in ("params", "opt_state"))
    assert needed <= sum(r.body_bytes for r in sent) <= 1.1 * needed


def test_only_the_items_restored_are_fetched(zstd_store, proxy):
    """Without the optimizer: not one byte of its data files leaves the server."""
    local, url = zstd_store
    _, want = hybridckpt.restore(str(local.parent), fit("tp=2"), optimizer=False)
    _, got = hybridckpt.restore(url, fit("tp=2"), optimizer=False)
    assert got.opt_state is None and leaves(got.params) == leaves(want.params)
    requests = proxy.snapshot()
    assert data_gets(requests, f"/{BUCKET}/zstd/{local.name}/opt_state/") == []
    sent = data_gets(requests, f"/{BUCKET}/zstd/{local.name}/params/")
    assert 0 < sum(r.body_bytes for r in sent) <= 1.1 * chunk_bytes(local / "params")


def test_a_damaged_chunk_in_the_bucket_is_one_line_naming_its_url(zstd_store, s3):
    """One byte of one chunk changed in the bucket (sizes kept: the commit marker still fits):
    the chunk's CRC-32 names it, the message names the bucket's URL (not the local view)."""
    local, url = zstd_store
    fs = client(s3)
    damaged = f"{BUCKET}/damaged"
    for key in fs.find(f"{BUCKET}/zstd"):  # (the commit marker too)
        fs.copy(key, damaged + key[len(f"{BUCKET}/zstd"):])
    params = os.path.join(view.local_path(url), local.name, "params")  # (its own data files' names)
    index = read_index(params)
    key, loc = next((k, v) for k, v in sorted(index.locations.items()) if k.startswith("layers.q.kernel/"))
    obj = f"{damaged}/{local.name}/params/{os.path.relpath(loc.path, params)}"
    data = bytearray(fs.cat_file(obj))
    data[loc.offset + loc.length // 2] ^= 0x5A
    fs.pipe_file(obj, bytes(data))
    with pytest.raises(CheckpointError) as e:
        hybridckpt.restore(f"s3://{damaged}", SAVED)
    msg = str(e.value)
    assert "\n" not in msg and f"s3://{damaged}/{local.name}/params" in msg and "hybridckpt-view" not in msg, msg
    assert "layers.q.kernel" in msg and ("CRC-32" in msg or "cannot read" in msg), msg


def test_the_server_killed_mid_restore_is_one_line(s3_killable, local_sources, monkeypatch):
    from hybridckpt.containers.orbax import reader

    client(s3_killable).mkdir("kill")
    assert hybridckpt.cli.main(["import", local_sources["dcp"], "s3://kill/zstd", "--compression", "zstd"]) == 0
    real, calls = reader.OrbaxArray.read_box, []

    def kill_on_the_third_read(self, box):  # metadata read, some chunks read: then the server is gone
        calls.append(box)
        if len(calls) == 3:
            s3_killable.kill()
        return real(self, box)

    monkeypatch.setattr(reader.OrbaxArray, "read_box", kill_on_the_third_read)
    monkeypatch.setattr(ranged, "TRIES", 2)  # (TensorStore's retries as ours: bounded, and brief here)
    with pytest.raises(CheckpointError) as e:
        hybridckpt.restore("s3://kill/zstd", SAVED)
    msg = str(e.value)
    assert "\n" not in msg and "s3://kill/zstd/" in msg and "hybridckpt-view" not in msg, msg
    assert len(calls) >= 3


def test_an_import_summary_counts_every_byte_tensorstore_fetched(zstd_store, proxy, tmp_path, capsys):
    """The summary's requests for the host (`--json`) hold TensorStore's GETs whole: their bytes
    arrive after the GET is counted, and were once dropped when no new GET came with them."""
    import json

    _, url = zstd_store
    capsys.readouterr()
    assert hybridckpt.cli.main(["import", url, str(tmp_path / "out"), "--mesh", fit("tp=2"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["requests"][proxy.endpoint.split("://", 1)[1]]
    gets = [r for r in proxy.snapshot() if r.method == "GET" and "list-type" not in r.query]  # (objects, not LISTs)
    assert data_gets(gets, f"/{BUCKET}/zstd/")  # TensorStore's GETs among them
    assert summary["requests"] >= len(gets) and summary["bytes"] >= sum(r.body_bytes for r in gets)


def test_an_ocdbt_store_restored_from_gcs_equals_the_local_restore(gcs, zstd_store, local_sources, monkeypatch):
    from gcsfs.core import GCSFileSystem

    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)  # (the one ts_kvstore sets: gone after)
    local, _ = zstd_store
    fs = GCSFileSystem(skip_instance_cache=True)
    if not fs.exists("ocdbt-gcs"):
        fs.mkdir("ocdbt-gcs")
    assert hybridckpt.cli.main(["import", local_sources["dcp"], "gs://ocdbt-gcs/zstd", "--compression", "zstd",
                                "--mesh", SAVED]) == 0
    _, want = hybridckpt.restore(str(local.parent), fit("tp=2"), verify_reads=False)
    _, got = hybridckpt.restore("gs://ocdbt-gcs/zstd", fit("tp=2"), verify_reads=False)
    a, b = leaves((want.params, want.opt_state)), leaves((got.params, got.opt_state))
    assert sorted(a) == sorted(b) and len(a) > 20 and [k for k in a if a[k] != b[k]] == []
