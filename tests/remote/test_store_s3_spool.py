"""An import into a bucket keeps only the chunks in flight in its spool (issue 43): each raw chunk
file goes up as soon as it is written (`containers.orbax.chunk_files` -> `io.sequential_file.closed`
-> `writers.remote`) under the name Orbax's rename will give it, and is removed from the spool;
the spool is counted at every upload (files and bytes), never timed. The result still equals the
local import bit for bit, and a server killed while the chunks go up leaves one line, exit 2, no
commit marker.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading

import jax
import pytest
from meshes import fit
from test_export_s3 import cli, client, refused
from test_remote_import import stable_digest

from hybridckpt.containers.orbax import chunk_files
from hybridckpt.demo import sample_path
from hybridckpt.errors import CheckpointError
from hybridckpt.io import sequential_file
from hybridckpt.io.remote import commit as markers
from hybridckpt.io.remote import urls
from hybridckpt.lazy import parallel
from hybridckpt.writers import ownership, remote

CHUNK = re.compile(r"\d+(\.\d+)*")  # a zarr v2 chunk key ("0", "1.0.2")


@pytest.fixture
def spool(tmp_path, monkeypatch):
    """The spool's parent folder (`tempfile`'s), and the uploads seen: for each, the chunk files
    and their bytes in the spool at that moment, and whether it was a chunk."""
    where = tmp_path / "spooltmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    seen: list[tuple[int, int, bool, str]] = []
    real = remote.upload_file
    # the chunk files in the spool, from the moment one is created to its removal, under a lock:
    # a walk of the spool is no snapshot (a thread's next chunk, written while the walk went on,
    # and its last one, removed meanwhile, were both counted: 5 files seen with 4 writers)
    live: set[str] = set()
    lock = threading.Lock()
    real_write, real_remove = chunk_files._write_file, os.remove

    def write_file(path, *a):
        if path.startswith(str(where)):
            with lock:
                live.add(path)
        return real_write(path, *a)

    def remove(path, *a, **k):
        real_remove(path, *a, **k)
        with lock:
            live.discard(os.fspath(path))

    monkeypatch.setattr(chunk_files, "_write_file", write_file)
    monkeypatch.setattr(os, "remove", remove)

    def upload(fs_, local, path, part_bytes=None):
        with lock:
            files = sorted(live)
        seen.append((len(files), sum(map(_size, files)), bool(CHUNK.fullmatch(path.rsplit("/", 1)[-1])), path))
        return real(fs_, local, path, part_bytes)

    monkeypatch.setattr(remote, "upload_file", upload)
    return where, seen


def _size(path: str) -> int:
    """Bytes of `path`, 0 once another reader thread's upload has removed it (after the walk)."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def test_chunks_go_up_as_written_and_the_spool_holds_only_those_in_flight(s3, spool, tmp_path, monkeypatch,
                                                                        capsys):
    where, seen = spool
    monkeypatch.setenv(parallel.ENV, "4")  # (the bound below, whatever this machine's core count)
    staged = []  # the staging marker's rewrites: one per chunk folder, not one per chunk
    real_put = remote.RemoteDestination._put
    monkeypatch.setattr(remote.RemoteDestination, "_put",
                        lambda self, name, data: (staged.append(data) if name == markers.STAGING else None,
                                                  real_put(self, name, data))[1])
    fs = client(s3)
    fs.mkdir("spooled")
    assert cli(capsys, "import", sample_path(), tmp_path / "local", "--mesh", fit("fsdp=2,tp=2"))[0] == 0
    want = stable_digest(tmp_path / "local")
    chunks = {k: v for k, v in want.items() if CHUNK.fullmatch(k.rsplit("/", 1)[-1])}
    # many more chunks than the 6 writers (fewer on fewer devices: 64 on one, as its mesh cuts fewer)
    assert len(chunks) > (100 if jax.device_count() >= 4 else 40)
    biggest = max(os.path.getsize(tmp_path / "local" / k) for k in chunks)

    code, _, err = cli(capsys, "import", sample_path(), "s3://spooled/ck", "--mesh", fit("fsdp=2,tp=2"))
    assert code == 0, err
    uploaded = [p.split("spooled/ck/", 1)[1] for *_, p in seen]
    assert sorted(p for p in uploaded if CHUNK.fullmatch(p.rsplit("/", 1)[-1])) == sorted(chunks)
    assert not any(".orbax-checkpoint-tmp" in p for p in uploaded)  # final names, as after Orbax's rename
    # every chunk went up before the first file of the commit: the spool never held the step
    first_commit = next(i for i, (*_, chunk, _p) in enumerate(seen) if not chunk)
    assert all(chunk for *_, chunk, _p in seen[:first_commit]) and first_commit == len(chunks)
    peak_files = max(n for n, *_ in seen)
    peak_bytes = max(b for _, b, *_ in seen)
    workers = parallel.write_threads()  # (each writer thread writes, then uploads, one chunk at a time)
    assert peak_files <= workers < len(chunks) and peak_bytes <= workers * biggest
    assert os.listdir(where) == []  # the spool removed
    folders = {k.rsplit("/", 1)[0] + "/" for k in chunks}
    assert len(staged) <= 1 + len(folders) + (len(uploaded) - len(chunks))
    assert sorted(json.loads(staged[-1])["folders"]) == sorted(folders)

    fs.invalidate_cache()
    fs.get("spooled/ck/", str(tmp_path / "fetched") + "/", recursive=True)
    got = stable_digest(tmp_path / "fetched")
    got.pop(ownership.MARKER)
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []  # bitwise, every file


def test_the_server_killed_while_chunks_go_up_leaves_one_line_and_no_commit_marker(s3_killable, monkeypatch,
                                                                                    tmp_path, capsys):
    fs = client(s3_killable)
    fs.mkdir("cut")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = remote.upload_file
    uploaded = []

    def upload(fs_, local, path, part_bytes=None):
        if len(uploaded) == 5:
            s3_killable.kill()  # this chunk's upload and every later request refused
        uploaded.append(path)
        return real(fs_, local, path, part_bytes)

    monkeypatch.setattr(remote, "upload_file", upload)
    line = refused(cli(capsys, "import", sample_path(), "s3://cut/ck"), "s3://cut/ck", "upload failed")
    assert "\n" not in line.strip()
    assert len(uploaded) >= 6 and all(CHUNK.fullmatch(p.rsplit("/", 1)[-1]) for p in uploaded)  # mid-save
    assert not any(markers.MARKER in p for p in uploaded)
    assert os.listdir(tmp_path) == []  # nothing left in the spool's folder


def test_chunks_left_by_a_job_cut_short_are_replaced_by_overwrite(s3, monkeypatch, tmp_path, capsys):
    """The cleaning fails (the server gone): the chunks that went up stay, named by the staging
    marker's folders, so the next import with --overwrite recognises them as ours."""
    fs = client(s3)
    fs.mkdir("left")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = remote.upload_file
    monkeypatch.setattr(remote.RemoteDestination, "_clean", lambda self: None)

    def upload(fs_, local, path, part_bytes=None):
        if not CHUNK.fullmatch(path.rsplit("/", 1)[-1]):  # the first upload of the commit: every chunk is up
            raise ConnectionResetError("connection reset by peer (injected)")
        return real(fs_, local, path, part_bytes)

    monkeypatch.setattr(remote, "upload_file", upload)
    refused(cli(capsys, "import", sample_path(), "s3://left/ck"), "upload failed")
    fs.invalidate_cache()
    left = [p for p in fs.find("left/ck") if not p.endswith(markers.STAGING)]
    assert len(left) > 30 and all(CHUNK.fullmatch(p.rsplit("/", 1)[-1]) for p in left)
    monkeypatch.setattr(remote, "upload_file", real)
    refused(cli(capsys, "import", sample_path(), "s3://left/ck"), "not finished", "--overwrite")
    assert cli(capsys, "import", sample_path(), "s3://left/ck", "--overwrite")[0] == 0
    fs.invalidate_cache()
    markers.check_complete(fs, urls.parse("s3://left/ck"))
    marker = json.loads(fs.cat_file(f"left/ck/{markers.MARKER}"))
    assert sorted(marker["files"]) == sorted(p.split("left/ck/", 1)[1] for p in fs.find("left/ck")
                                             if not p.endswith(markers.MARKER))


@pytest.mark.parametrize("spooled,name", [
    ("12.orbax-checkpoint-tmp/params.orbax-checkpoint-tmp/embed/0.0", "12/params/embed/0.0"),
    ("3.orbax-checkpoint-tmp-1700000000/items.orbax-checkpoint-tmp-17/a.b/1", "3/items/a.b/1"),
    # an array's folder is the checkpoint's data: never renamed
    ("12.orbax-checkpoint-tmp/params.orbax-checkpoint-tmp/x.orbax-checkpoint-tmp/0",
     "12/params/x.orbax-checkpoint-tmp/0"),
    ("12/params/embed/0.0", "12/params/embed/0.0"),
    ("model-00001-of-00002.safetensors", "model-00001-of-00002.safetensors"),
    ("ck/12.orbax-checkpoint-tmp/params.orbax-checkpoint-tmp/embed/0", "ck/12.orbax-checkpoint-tmp/params.orbax-checkpoint-tmp/embed/0"),
    ("12.orbax-checkpoint-tmp/Params.orbax-checkpoint-tmp/embed/0", "12.orbax-checkpoint-tmp/Params.orbax-checkpoint-tmp/embed/0"),
])
def test_the_final_name_of_a_chunk_is_orbax_s_rename_of_step_and_item_folders_only(spooled, name):
    assert remote.final_name(spooled) == name


def test_a_chunk_orbax_did_not_rename_is_never_committed(s3, monkeypatch, tmp_path):
    """A chunk in a temporary folder of another layout waits for the commit; one uploaded early
    whose folder Orbax did not rename refuses the commit, and what went up is deleted."""
    fs = client(s3)
    fs.mkdir("norename")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dest = remote.RemoteDestination(urls.parse("s3://norename/ck"))
    with dest as spool:
        for rel in ("x/3.orbax-checkpoint-tmp/items.orbax-checkpoint-tmp/a/0",
                    "3.orbax-checkpoint-tmp/items.orbax-checkpoint-tmp/a/0"):
            path = os.path.join(spool, *rel.split("/"))
            os.makedirs(os.path.dirname(path))
            with open(path, "wb") as f:
                f.write(b"chunk")
            sequential_file.closed(path)
        fs.invalidate_cache()
        assert [p for p in fs.find("norename/ck") if not p.endswith(markers.STAGING)] == ["norename/ck/3/items/a/0"]
        assert os.path.exists(os.path.join(spool, "x/3.orbax-checkpoint-tmp/items.orbax-checkpoint-tmp/a/0"))
        assert not os.path.exists(os.path.join(spool, "3.orbax-checkpoint-tmp/items.orbax-checkpoint-tmp/a/0"))
        with pytest.raises(CheckpointError, match="did not rename"):
            dest.commit()
    fs.invalidate_cache()
    assert fs.find("norename/ck") == []
