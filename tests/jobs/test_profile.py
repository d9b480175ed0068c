"""The account of a job's time (issue 42) on a tiny import, restore and export: every stage
present, the bytes read and written equal to the sizes of the files (counted, not timed), the
shares summing to the wall time; `--profile` and `--json` on the CLI; nothing recorded when off."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time

import pytest
from meshes import fit

import hybridckpt
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.io import timing
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import tally
from hybridckpt.jobs.export import export_checkpoint
from hybridckpt.jobs.import_ import import_checkpoint

IMPORT_STAGES = {"start", "open", "plan", "read", "cut", "checksum", "write", "sync", "metadata"}
CHUNK_FILE = re.compile(r"^\d+(\.\d+)*$")  # a raw zarr chunk: its grid position


def data_bytes(path: str, leave_out: tuple[str, ...] = ()) -> int:
    """The tensor bytes of a safetensors file, less those of the tensors `leave_out`."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(b - a for k, v in header.items() if k != "__metadata__" and k not in leave_out
               for a, b in [v["data_offsets"]])


def chunk_file_bytes(ck: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ck) for f in fs if CHUNK_FILE.match(f))


def safetensors_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def check_sums(p: timing.Profile, abs_s: float = 0.0) -> None:
    """The account's sums (`abs_s`: seconds of rounding, a profile read back from JSON)."""
    shares = sum(s.share_s for s in p.stages)
    assert shares + p.other_s == pytest.approx(p.wall_s, rel=1e-9, abs=abs_s)
    assert shares <= p.wall_s * (1 + 1e-9) + abs_s
    for s in p.stages:  # a stage's wall-clock time is at most the job's, its share at most that
        assert s.share_s <= s.wall_s * (1 + 1e-9) + abs_s and s.wall_s <= p.wall_s * (1 + 1e-9) + abs_s
        assert s.busy_s == pytest.approx(sum(w.busy_s for w in p.workers if w.stage == s.stage), rel=1e-9,
                                         abs=abs_s)
        assert s.bytes == sum(w.bytes for w in p.workers if w.stage == s.stage)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "src"
    shutil.copytree(sample_path(), path)
    return str(path)


def test_import_restore_export_account_for_every_byte(src, tmp_path):
    files = [os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors")]
    source_bytes = sum(data_bytes(f, leave_out=("step",)) for f in files)  # (the step: read by open, a number)
    s = import_checkpoint(src, tmp_path / "ck", mesh=fit("fsdp=2,tp=2"), profile=True)
    p = s.profile
    check_sums(p)
    assert {st.stage for st in p.stages} == IMPORT_STAGES
    assert p.stage("read").bytes == source_bytes  # every tensor byte of the source, read once
    assert p.stage("write").bytes == chunk_file_bytes(str(tmp_path / "ck"))  # every chunk file, whole
    assert p.stage("checksum").bytes == s.bytes + 4  # every array byte written and the int32 step counter, once
    assert p.stage("sync").calls >= 1  # (one syncfs an item, or an fsync a chunk file: tests/store/test_import_writes.py)
    assert s.seconds <= p.wall_s
    assert any(w.worker.startswith("hybridckpt-io") and w.stage == "read" for w in p.workers)
    # the chunk files written by the writer pool, not by the readers (`stream_orbax._write_tile`)
    written = {w.worker for w in p.workers if w.stage == "write"}
    assert written and all(w.startswith("hybridckpt-chunk-write") for w in written), written

    with count_reads() as counter:
        _, r = hybridckpt.restore(str(tmp_path / "ck"), fit("fsdp=4"), profile=True)
    check_sums(r.profile)
    assert {"metadata", "plan", "read", "checksum", "transfer"} <= {st.stage for st in r.profile.stages}
    assert r.profile.stage("read").bytes == tally(counter)[0]  # what the chunk files gave
    assert r.profile.stage("checksum").bytes == r.profile.stage("read").bytes  # each chunk read checked
    placed = sum(x.nbytes for x in [*hybridckpt.naming.flatten(r.params).values()])
    assert r.profile.stage("transfer").bytes >= placed  # each device's shard (replicas: once per device)

    e = export_checkpoint(tmp_path / "ck", tmp_path / "out", optimizer=True, profile=True)
    check_sums(e.profile)
    assert {"start", "open", "read", "checksum", "write", "sync"} <= {st.stage for st in e.profile.stages}
    assert e.profile.stage("write").bytes == safetensors_bytes(str(tmp_path / "out"))  # header and data
    assert e.profile.stage("read").bytes == e.bytes  # the tensors, from the chunk files
    assert e.profile.stage("checksum").bytes == e.bytes + 4  # every chunk read checked (the step counter's when opened)

    with count_reads():  # an HF source copied to HF: the stored runs go file to file
        e2 = export_checkpoint(src, tmp_path / "out2", optimizer=True, profile=True)
    assert e2.profile.stage("read").bytes == source_bytes  # (the step: read when opened)
    assert e2.profile.stage("write").bytes == safetensors_bytes(str(tmp_path / "out2"))


def test_off_records_nothing(src, tmp_path, monkeypatch):
    calls = []
    for name in ("switch", "add"):
        original = getattr(timing._Account, name)
        monkeypatch.setattr(timing._Account, name,
                            lambda self, *a, _o=original, _n=name: calls.append(_n) or _o(self, *a))
    s = import_checkpoint(src, tmp_path / "ck", mesh=fit("fsdp=2"))
    _, r = hybridckpt.restore(str(tmp_path / "ck"), fit("fsdp=2"))
    e = export_checkpoint(tmp_path / "ck", tmp_path / "out", optimizer=True)
    assert (s.profile, r.profile, e.profile) == (None, None, None)
    assert calls == []  # not one call into an accumulator: the stages were the shared no-op


def test_cli_profile_table_and_json(src, tmp_path, capsys):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    assert main(["import", src, ck, "--mesh", fit("fsdp=2"), "--profile", "--quiet"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0] for line in text.splitlines() if line and not line.startswith(" ")}
    assert IMPORT_STAGES | {"other/waiting", "wall", "stage", "per"} <= rows
    assert re.search(r"^  hybridckpt-io_\d+: read ", text, re.M)  # per worker

    assert main(["export", ck, out, "--optimizer", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["destination"] == os.path.abspath(out) and doc["with_optimizer"] is True
    stages = {s["stage"]: s for s in doc["profile"]["stages"]}
    assert stages["write"]["bytes"] == safetensors_bytes(out)
    assert sum(s["share_s"] for s in stages.values()) + doc["profile"]["other_s"] == pytest.approx(
        doc["profile"]["wall_s"], abs=1e-5)
    assert {w["worker"] for w in doc["profile"]["workers"]} >= {"MainThread"}

    assert main(["import", src, ck, "--mesh", fit("fsdp=2"), "--json", "--overwrite", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)  # the replaced import deleted: a stage of its own
    assert doc["bytes"] > 0 and {s["stage"] for s in doc["profile"]["stages"]} == IMPORT_STAGES | {"remove"}
    assert next(s for s in doc["profile"]["stages"] if s["stage"] == "remove")["calls"] == 1

    assert main(["import", src, str(tmp_path / "ck3"), "--plan", "--profile"]) == 2  # --plan imports nothing
    assert "--profile" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "ck3")


def test_the_command_accounts_for_its_process_from_its_start(src, tmp_path):
    """Run as the `hybridckpt` command (its own process: `cli.run`), the account starts at the
    process's start, by the kernel's record: a stage "launch" first, which holds the 0.5 s the
    child sleeps before the CLI is even loaded; the shares still sum to the wall, which is at
    most the child's wall as its parent measured it. In-process (`main`, above) there is none."""
    code = ("import sys, time, runpy; time.sleep(0.5); sys.argv = ['hybridckpt'] + sys.argv[1:]; "
            "runpy.run_module('hybridckpt.cli', run_name='__main__')")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, "import", src, str(tmp_path / "ck"), "--mesh", fit("fsdp=2"),
                           "--json", "--quiet"], capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    p = timing.Profile.from_json(json.loads(done.stdout)["profile"])
    check_sums(p, abs_s=1e-4)  # (each figure rounded to microseconds, a hundred of them summed)
    assert [s.stage for s in p.stages] == ["launch", *sorted(IMPORT_STAGES, key=timing.STAGES.index)]
    assert 0.5 <= p.stage("launch").share_s < p.wall_s <= wall
    assert p.stage("start").busy_s > 0  # (the job's own stages follow, as in-process)
