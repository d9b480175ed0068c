"""Multi-host imports from a bucket (issue 43): 2 local processes under `jax.distributed` (gloo on
127.0.0.1, half of this session's devices each as simulated CPU devices), each importing a DCP
written by torch FSDP2 and an HF sharded folder written by transformers from `s3://` on the
local moto server onto a mesh that spans both processes.

Each process talks to the server through its own counting proxy (`fixtures.counting_proxy`), so
the server's side of each process's requests is counted apart: every GET and its bytes.

- the two processes' checkpoint equals the single-process import of the local folder, every
  file bit for bit (less Orbax's per-process records and device numbering);
- each process's readers asked only for its own devices' ranges: what the plan of that process
  (`--processes 2 --process P` of the local copy) reads from a local disk, the needed bytes of
  the two each byte once (at most 1.1x the tensors' bytes); the server sent each process only
  those ranges, coalesced across gaps under 64 KiB and read ahead (a range-by-range check of
  every GET its proxy saw); its summary's `requests` are exactly what its proxy saw; its
  `import --plan --process P` (under jax.distributed) said beforehand, per host, what it fetched
  (bytes at most 1.1x the plan's, plus the headers its open reads);
- only the coordinating process puts the destination in place (the commit rename); a process
  killed mid-import leaves no committed destination, and the next import cleans what it left.

A mesh axis between the hosts that cuts rows into strips under 64 KiB (here tp: `o_proj`,
`down_proj`) has each host fetch the gaps between its strips, coalesced (a local read joins
them into spans too, with a smaller gap); so what a host fetches is bounded by its plan's
requests, not by the bytes its devices hold (docs/cli.md, Sources in object storage).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from fixtures import remote_sources
from fixtures.counting_proxy import CountingProxy
from fixtures.torch_common import free_port
from meshes import fit
from test_remote_import import stable_digest

from hybridckpt.io.remote import ranged
from hybridckpt.jobs.plan_report import plan_import

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")
DATA = (".safetensors", ".distcp")
LOCAL = max(1, jax.device_count() // 2)  # CPU devices per process
MESH = fit("tp=4,pp=2", 2 * LOCAL)  # the processes split tp: o_proj and down_proj by columns
# 2 processes with a device each at least: the devices present must hold them (at 1 device the
# single-process references on MESH, tp=2, could not be built and 2 processes cannot divide 1 device)
TWO_PROCESSES = pytest.mark.skipif(jax.device_count() < 2, reason="2 processes need 2 devices, one each")


SIZES = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 512}
MARK = "/hybridckpt-test-mark/"  # the worker's mark in its proxy's log after each command


@pytest.fixture(scope="module")
def local_sources(tmp_path_factory):
    """A Llama whose matrices are 128 to 512 KiB: "hf" (transformers, 1 MB shards), "dcp" (FSDP2)."""
    return {"hf": remote_sources.hf_sharded(str(tmp_path_factory.mktemp("hf")), "1MB", **SIZES),
            "dcp": remote_sources.dcp_fsdp2(str(tmp_path_factory.mktemp("dcp")), **SIZES)}


@pytest.fixture
def in_bucket(s3, local_sources):
    """name -> the `s3://` URL of each local source uploaded."""
    return {name: remote_sources.in_bucket(s3, local) for name, local in local_sources.items()}


def run_pair(tmp_path, server, commands, faults=({}, {}), heartbeat_s=100, timeout=300):
    """Run `commands(pid)` (hybridckpt argv lists) in 2 processes under jax.distributed, each through
    its own proxy; returns (return codes, outputs, per-process results or None, proxies' requests)."""
    proxies = [CountingProxy(server.port) for _ in range(2)]
    port = free_port()
    procs, outs = [], []
    try:
        for pid in range(2):
            env_s3 = {**server.env(), "AWS_ENDPOINT_URL": proxies[pid].endpoint,
                      "AWS_ENDPOINT_URL_S3": proxies[pid].endpoint}
            out = str(tmp_path / f"p{pid}.json")
            spec = {"process": pid, "port": port, "local": LOCAL, "env": env_s3, "heartbeat_s": heartbeat_s,
                    "out": out, "commands": commands(pid), **faults[pid]}
            with open(tmp_path / f"spec{pid}.json", "w") as f:
                json.dump(spec, f)
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "AWS_PROFILE")}
            # its spool and bucket views under the test's folder: a worker the test SIGKILLs runs no
            # clean-up (atexit included), and what it leaves must not pile up in the machine's /tmp
            os.makedirs(tmp_path / f"tmp{pid}", exist_ok=True)
            env["TMPDIR"] = str(tmp_path / f"tmp{pid}")
            outs.append(out)
            procs.append(subprocess.Popen([sys.executable, WORKER, str(tmp_path / f"spec{pid}.json")], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for x in proxies:
            x.close()
    results = [json.load(open(o)) if os.path.exists(o) else None for o in outs]
    return [p.returncode for p in procs], logs, results, [per_command(x.snapshot()) for x in proxies], proxies


def per_command(requests) -> list[list]:
    """A proxy's log cut at the worker's marks: the requests of each command."""
    out: list[list] = [[]]
    for r in requests:
        if r.path.startswith(MARK):
            out.append([])
        else:
            out[-1].append(r)
    return out


def below(requests, url: str):
    """The requests of a proxy's log for objects below `url`'s prefix (its LIST included)."""
    bucket, prefix = url[len("s3://"):].split("/", 1)
    return [r for r in requests if r.path.startswith(f"/{bucket}/{prefix}/")
            or (r.path.rstrip("/") == f"/{bucket}" and f"prefix={prefix}" in r.query)]


def merged(ranges) -> list[tuple[int, int]]:
    """`[start, end)` ranges sorted and joined where they touch or overlap."""
    out: list[list[int]] = []
    for a, b in sorted(tuple(r) for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def nbytes(ranges) -> int:
    return sum(b - a for a, b in merged(ranges))


def fetched(requests, url: str) -> dict[str, list[tuple[int, int]]]:
    """Object key -> the byte ranges of the ranged GETs of data objects below `url` (Range headers)."""
    out: dict[str, list] = {}
    for r in below(requests, url):
        if r.method == "GET" and r.path.endswith(DATA):
            a, b = r.range.removeprefix("bytes=").split("-")
            out.setdefault(r.path.lstrip("/"), []).append((int(a), int(b) + 1))
    return out


def digest(root) -> dict[str, bytes]:
    """`stable_digest` less what Orbax writes per process (`array_metadatas/process_<i>`), with
    the device ids of its `_sharding` records as one process numbers them (process p's CPU
    device i is id `p * 2048 + i` under jax.distributed): the differences between a 1-process
    and a 2-process save of one mesh."""
    out = {k: v for k, v in stable_digest(root).items() if "/array_metadatas/" not in k}
    for rel in [r for r in out if r.endswith("/_sharding")]:
        out[rel] = re.sub(rb'(id\\*": *)(\d+)',
                          lambda m: m[1] + b"%d" % ((int(m[2]) // 2048) * LOCAL + int(m[2]) % 2048), out[rel])
    return out


@TWO_PROCESSES
def test_two_processes_read_their_own_ranges_from_the_bucket(s3, local_sources, in_bucket, tmp_path, capsys):
    from hybridckpt.cli import main

    def commands(pid: int) -> list[list[str]]:  # the imports, each one's plan of this process, a plan of all
        imports = [["import", in_bucket[n], str(tmp_path / f"{n}-ckpt"), "--mesh", MESH, "--json"] for n in ("hf", "dcp")]
        return imports + [[*argv[:2], str(tmp_path / "unused"), "--mesh", MESH, "--plan", "--json", "--process",
                           str(pid)] for argv in imports] + [[*imports[0][:-1], "--plan"]]

    rcs, logs, results, seen, proxies = run_pair(tmp_path, s3, commands)
    assert rcs == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert [r["process_index"] for r in results] == [0, 1] and {r["local_devices"] for r in results} == {LOCAL}
    assert all(c["rc"] == 0 and not c["stderr"] for r in results for c in r["results"])
    assert not os.path.exists(tmp_path / "unused")  # --plan writes nothing
    for i, n in enumerate(("hf", "dcp")):
        url, dst = in_bucket[n], str(tmp_path / f"{n}-ckpt")
        # (a) one checkpoint, bit for bit the single-process import of the local copy
        assert main(["import", local_sources[n], str(tmp_path / f"{n}-local"), "--mesh", MESH]) == 0
        capsys.readouterr()
        a, b = digest(tmp_path / f"{n}-local"), digest(dst)
        assert sorted(a) == sorted(b) and len(a) > 3, (sorted(a), sorted(b))
        assert [k for k in a if a[k] != b[k]] == [], [(a[k][:300], b[k][:300]) for k in a if a[k] != b[k]]
        # only the coordinating process put it in place
        assert [r["results"][i]["renames"] for r in results] == [[dst], []]
        # (b) each process's readers asked for its own devices' ranges only: what the plan of that
        # process's devices reads from a local disk (`--processes 2 --process P`: its bytes, and
        # the gaps of the spans it joins), the two processes' needed bytes each byte once
        need = plan_import(local_sources[n], mesh=MESH, processes=2)
        asked = [results[p]["results"][i]["needed"] for p in range(2)]
        mine = [plan_import(local_sources[n], mesh=MESH, processes=2, process=p).processes[0] for p in range(2)]
        local = [x.bytes_read + x.gap_bytes for x in mine]  # what each reads from a local disk (with its spans' gaps)
        for p in range(2):
            assert mine[p].bytes_read <= sum(nbytes(r) for r in asked[p].values()) <= 1.01 * local[p], (n, p)
        assert sum(x.bytes_read for x in need.processes) <= 1.1 * need.tensor_bytes  # each byte by one process
        assert max(local) < 0.7 * sum(os.path.getsize(os.path.join(local_sources[n], f))
                                      for f in os.listdir(local_sources[n]) if f.endswith(DATA))  # split
        # what the server sent each process (its proxy): only its own needed ranges, coalesced
        # across gaps under ranged.COALESCE_GAP_BYTES (plus a small read's read-ahead)
        for p in range(2):
            got = fetched(seen[p][i], url)
            for key, ranges in got.items():
                wanted = merged(asked[p][key])
                for a, b in merged(ranges):
                    inside = [(x, y) for x, y in wanted if x < b and y > a]
                    assert inside and inside[0][0] == a, (n, p, key, a, b)  # starts at a needed byte
                    holes = [inside[j + 1][0] - inside[j][1] for j in range(len(inside) - 1)]
                    assert all(h <= ranged.COALESCE_GAP_BYTES for h in holes), (n, p, key, holes)
                    assert b - inside[-1][1] <= ranged.READAHEAD_BYTES, (n, p, key)
            # its summary's requests are what its proxy saw (LIST, metadata GETs, ranged GETs, HEADs)
            summary = json.loads(results[p]["results"][i]["stdout"])
            reqs = below(seen[p][i], url)
            host = f"127.0.0.1:{proxies[p].port}"
            assert summary["requests"] == {host: {
                "requests": len(reqs),
                "bytes": sum(r.body_bytes for r in reqs if r.method == "GET" and "list-type" not in r.query)}}
            # and its --plan (under jax.distributed) said so beforehand: each process's requests
            plan = json.loads(results[p]["results"][2 + i]["stdout"])
            assert [(x["process"], x["bytes_read"]) for x in plan["processes"]] == [(p, mine[p].bytes_read)]
            assert list(plan["processes"][0]["requests"]) == [host]
            data = [r for r in reqs if r.method == "GET" and r.path.endswith(DATA)]
            planned = plan["processes"][0]["requests"][host]
            files = len([f for f in os.listdir(local_sources[n]) if f.endswith(DATA)])
            # (+ what opening each data file reads: a safetensors header, at most 2 GETs of a read-ahead;
            # a read split at the ranges another device of the process fetched: a few more GETs. A DCP
            # chunk's two ends are read before its elements (`formats.dcp.chunk`): where the ends
            # were cached first, the elements' read is split at them, a split the plan does not
            # model: 126 GETs against 108 planned for one process here, the bytes as planned)
            assert len(data) <= 1.2 * planned["requests"] + 2 * files
            assert sum(r.body_bytes for r in data) <= 1.1 * planned["bytes"] + files * ranged.READAHEAD_BYTES
    # a plan of all processes, printed by each of them: every process's requests, per host
    for p in range(2):
        text = results[p]["results"][4]["stdout"]
        for q in range(2):
            assert f"process {q}: bytes read" in text and f"from 127.0.0.1:{proxies[p].port}: " in text


class _Object:
    """An fsspec filesystem holding one object of `size` bytes (byte i is i % 251), counting GETs."""

    def __init__(self, size: int):
        self.data = (np.arange(size) % 251).astype(np.uint8).tobytes()
        self.gets = []

    def cat_file(self, key, start, end):
        self.gets.append((start, end))
        return self.data[start:end]


@pytest.mark.parametrize("ranges", [[(0, 8)], [(1000, 1100), (5000, 5004)], [(0, 70_000)],
                                    [(10, 20), (200_000, 200_100)], [(0, 40 << 20)]])
def test_a_planned_read_costs_what_the_read_asks(ranges):
    """`--plan`'s requests per device are the GETs the read makes on an empty cache: the
    read-ahead of a small read (a norm, a header) and the parts of a large one included."""
    from hybridckpt.io import byte_source
    from hybridckpt.io.remote.urls import parse

    fs = _Object(48 << 20)
    obj = ranged.RemoteObject(parse("s3://b/model.safetensors"), fs, len(fs.data), "host")
    out = memoryview(bytearray(sum(b - a for a, b in ranges)))
    at = [sum(b - a for a, b in ranges[:i]) for i in range(len(ranges))]
    with byte_source.count_reads(this_thread=True) as planned, byte_source.planning():
        byte_source._remote_into("model.safetensors", obj, ranges, out, at)
    ranged.forget()
    with byte_source.count_reads() as done:
        byte_source._remote_into("model.safetensors", obj, ranges, out, at)
    ranged.forget()
    assert bytes(out) == b"".join(fs.data[a:b] for a, b in ranges)
    assert (done[("host", "requests")], done[("host", "requested")]) == (len(fs.gets), sum(b - a for a, b in fs.gets))
    assert (planned[("host", "requests")], planned[("host", "requested")]) == \
        (done[("host", "requests")], done[("host", "requested")])


@TWO_PROCESSES
def test_a_process_killed_mid_import_leaves_no_committed_destination(s3, local_sources, tmp_path, capsys):
    """Process 1 is killed (SIGKILL) after its second ranged GET: process 0, the coordinator, never
    puts the destination in place (it waits for process 1 at the save's barriers until the
    coordination service gives it up), and the next import of the same destination cleans what
    the killed job left and writes it whole."""
    from hybridckpt.cli import main

    url = remote_sources.in_bucket(s3, local_sources["hf"])
    dst = tmp_path / "ckpt"
    rcs, logs, results, _, _ = run_pair(
        tmp_path, s3, lambda pid: [["import", url, str(dst), "--mesh", MESH]],
        faults=({}, {"kill_after_gets": 2}), heartbeat_s=5)
    assert rcs[1] == -9, logs[1][-2000:]
    assert rcs[0] != 0 and results[0] is None, logs[0][-2000:]  # the coordinator did not finish the job
    assert not dst.exists()  # nothing committed
    assert main(["import", url, str(dst), "--mesh", MESH]) == 0  # the next job: whole, nothing left beside it
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt")]  # no .lock, no .tmp-*
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 0
