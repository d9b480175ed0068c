"""Issue 37, "smaller ones": each found by a new user through the CLI or the Python API, each a
one-line error (exit 2) or the documented behaviour, pinned by a test that failed before the
fix. Items a..j of the issue, in order."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import hybridckpt
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.io.byte_source import close_all

CLI = [sys.executable, "-m", "hybridckpt.cli"]


def run(*args: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sets its own
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=env)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    close_all()
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code: int, err: str, *must: str) -> str:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    for m in must:
        assert m in err, (m, err)
    return err


def listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


# -- a: logits --out ----------------------------------------------------------------------------------


def test_logits_out_is_written_at_exactly_the_path_given_and_a_missing_folder_is_one_line(tmp_path):
    src = sample_path()
    r = run("logits", src, "--tokens", "1,2,3", "--out", "missing/x.npy", cwd=tmp_path)
    one_line(r.returncode, r.stderr, "--out missing/x.npy", "missing does not exist")
    assert "Traceback" not in r.stderr and listing(tmp_path) == []
    (tmp_path / "afile").write_text("mine")
    r = run("logits", src, "--tokens", "1,2,3", "--out", "afile/x.npy", cwd=tmp_path)
    one_line(r.returncode, r.stderr, "afile/x.npy")
    assert (tmp_path / "afile").read_text() == "mine"

    r = run("logits", src, "--tokens", "1,2,3", "--out", "out.txt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "written to out.txt" in r.stdout and listing(tmp_path) == ["afile", "out.txt"]
    expected = hybridckpt.logits(src, [1, 2, 3])
    np.testing.assert_array_equal(np.load(tmp_path / "out.txt"), expected)


def test_logits_out_that_cannot_be_written_is_one_line_and_leaves_the_old_file(tmp_path, capsys, monkeypatch):
    src = sample_path()
    old = tmp_path / "x.npy"
    old.write_bytes(b"the user's own file")
    real_save = np.save

    def disk_full(f, arr, **kw):  # half of the array written, then the disk is full
        real_save(f, arr, **kw)
        f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    code, _, err = cli(capsys, "logits", src, "--tokens", "1,2", "--out", old)
    one_line(code, err, f"--out {old}", "No space left on device")
    assert old.read_bytes() == b"the user's own file" and listing(tmp_path) == ["x.npy"]

    real_open = os.open

    def read_only(path, flags, *a, **kw):  # a read-only folder (even for root)
        if os.path.dirname(os.fspath(path)) == str(tmp_path) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(np, "save", real_save)
    monkeypatch.setattr(os, "open", read_only)
    code, _, err = cli(capsys, "logits", src, "--tokens", "1,2", "--out", tmp_path / "y.npy")
    one_line(code, err, "y.npy", "Permission denied")
    assert listing(tmp_path) == ["x.npy"]
    for bad, why in (("", "expected the path"), (tmp_path, "is a folder")):
        code, _, err = cli(capsys, "logits", src, "--tokens", "1,2", "--out", bad)
        one_line(code, err, why)


# -- b: restore of what is not one of ours --------------------------------------------------------------


def test_restore_of_an_absent_folder_creates_nothing_and_another_format_is_named_with_its_import(tmp_path, capsys):
    import pytest
    import torch
    import torch.distributed.checkpoint as dcp

    from hybridckpt.errors import CheckpointError

    absent = tmp_path / "nothere"
    with pytest.raises(CheckpointError, match="no such folder") as e:
        hybridckpt.restore(str(absent))
    assert "\n" not in str(e.value) and listing(tmp_path) == []

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(tmp_path / "dcp"))
    for src, fmt in ((sample_path(), "hf"), (str(tmp_path / "dcp"), "dcp")):
        before = listing(src)
        with pytest.raises(CheckpointError) as e:
            hybridckpt.restore(src)
        assert str(e.value).startswith(f"{src} is a {fmt} checkpoint, not a hybridckpt store; import it first"), e.value
        assert listing(src) == before
        code, _, err = cli(capsys, "verify", src)  # the command's words in the command line
        one_line(code, err, f"{src} is a {fmt} checkpoint, not a hybridckpt store",
                 f"import it first: hybridckpt import {src} DST")


# -- c: make_mesh takes the first N devices, as the CLI and restore do ------------------------------------


def test_make_mesh_takes_the_first_devices_its_sizes_multiply_to_like_every_job():
    import jax
    import pytest
    from meshes import fit

    from hybridckpt.errors import MeshError
    from hybridckpt.mesh import MeshShape

    shape = MeshShape.parse(fit("fsdp=2,tp=2"))  # 4 of the 8 devices
    m = hybridckpt.make_mesh(**shape.as_dict())
    assert list(m.devices.flat) == jax.devices()[: shape.size] and dict(m.shape) == shape.as_dict()
    from hybridckpt.mesh import as_mesh

    for given in (str(shape), shape, m):  # the one coercion every job uses
        assert as_mesh(given).devices.tolist() == m.devices.tolist()
    with pytest.raises(MeshError, match="expected a jax.sharding.Mesh, a MeshShape or text"):
        as_mesh(4)
    with pytest.raises(MeshError, match="sizes must be positive"):
        hybridckpt.make_mesh(tp=0)
