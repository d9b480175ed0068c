"""Crash safety: `hybridckpt import`, `hybridckpt export` and a CheckpointStore training loop
SIGKILLed at seeded points leave the previous complete checkpoint or nothing that looks
complete; a full disk or a read-only destination is a one-line error that writes nothing and
leaves the source as it was.

The kill machinery is `tests/attacks/crash.py`: the real CLI runs in a child process, the
marker that writing began is the destination's temporary sibling appearing (or the loop's
first saved step), and the kill comes after a seeded delay over the write phase measured by a
calibration run. "Complete" is checked, not assumed: `hybridckpt verify DST` against the
checksums recorded at import, `hybridckpt verify SRC OUT` bit for bit for an export, an exact
restore of the latest step for the loop.

The full-disk and read-only cases need no child where the tmpfs or the read-only bind mount can
be made (root): the CLI's `main` runs in this process and its exit code, stderr and what it
left are checked the same way. A child runs them where RLIMIT_FSIZE stands in for the tmpfs
(a limit of this process would also limit pytest), and always for `--to maxtext`, whose defect
was also a message at the interpreter's exit.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
from dataclasses import dataclass

import pytest
from attacks import crash

from hybridckpt.cli import main
from hybridckpt.io.byte_source import close_all

SEED = 7
KILLS = 6


def _digest(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return crash.write_hf_source(str(tmp_path_factory.mktemp("crash") / "hf"), seed=0)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another HF checkpoint, and a complete import of it: what an --overwrite replaces."""
    base = tmp_path_factory.mktemp("previous")
    hf = crash.write_hf_source(str(base / "hf"), seed=1)
    ckpt = str(base / "ckpt")
    code, text = crash._quiet_main(["import", hf, ckpt, "--quiet"])  # (complete: no kill, no child)
    assert code == 0, text
    return hf, ckpt


def _report(points) -> str:
    return "\n".join(f"{p.command} delay={p.delay:.3f}s overwrite={p.overwrite} killed={p.killed}: {p.outcome}"
                     for p in points)


def test_import_killed_at_seeded_points(src, other, tmp_path):
    points = crash.kill_imports(src, other[1], str(tmp_path), seed=SEED, n=KILLS)
    assert all(p.ok for p in points), _report(points)
    assert any(p.killed and p.outcome == "absent" for p in points), _report(points)  # mid-write kills
    # what a killed run left behind does not stop the next import to the same place
    dst = str(tmp_path / "import-kill0")
    if not os.path.exists(dst):
        assert crash.run(crash.cli("import", src, dst, "--quiet"), dst, None).returncode == 0
        assert crash.import_outcome(dst) == "complete"


def test_export_killed_at_seeded_points(src, other, tmp_path):
    points = crash.kill_exports(src, other[0], str(tmp_path), seed=SEED + 1, n=KILLS)
    assert all(p.ok for p in points), _report(points)
    assert any(p.killed for p in points), _report(points)


def test_training_loop_killed_restores_the_last_complete_step(tmp_path):
    points = crash.kill_training(str(tmp_path), seed=SEED + 2, n=KILLS)
    assert all(p.ok for p in points), _report(points)


# -- disk full, permission denied -------------------------------------------------------------


@contextlib.contextmanager
def _tmpfs(path, size: str):
    """A small tmpfs at `path` when this process may mount one (root), else None."""
    os.makedirs(path)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True)
    try:
        yield res.returncode == 0
    finally:
        if res.returncode == 0:
            subprocess.run(["umount", str(path)], capture_output=True)


@contextlib.contextmanager
def _read_only(path):
    """`path` made read-only: a read-only bind mount when we may mount (root bypasses mode
    bits), else mode 0500 (non-root). Yields the errno a write there gets."""
    os.makedirs(path)
    ok = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0
    ok = ok and subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode == 0
    if ok:
        try:
            yield errno.EROFS
        finally:
            subprocess.run(["umount", str(path)], capture_output=True)
        return
    if os.geteuid() == 0:  # root without CAP_SYS_ADMIN: nothing makes a directory unwritable
        pytest.fail("running as root without permission to mount: cannot make a read-only directory")
    os.chmod(path, 0o500)
    try:
        yield errno.EACCES
    finally:
        os.chmod(path, 0o700)


@dataclass(frozen=True)
class Ran:
    """What a user sees of one command: exit code and stderr."""

    returncode: int
    stderr: str


def _run_cli(capsys, *args: str, fsize: int | None = None, child: bool = False):
    """The CLI on `args`: in this process, or in a child when `child` or under RLIMIT_FSIZE
    `fsize` (bytes)."""
    if not child and fsize is None:
        capsys.readouterr()
        try:
            code = main(list(args))
        finally:
            close_all()
        return Ran(code, capsys.readouterr().err)

    def limit():
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(crash.cli(*args), capture_output=True, text=True, timeout=120,
                          preexec_fn=limit if fsize else None)


def _assert_clean_failure(res, dst: str, reasons: tuple[str, ...]):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    err = res.stderr
    assert err.startswith("hybridckpt: error:") and err.count("\n") == 1, err
    named = os.path.basename(dst) in err or os.path.dirname(dst) in err  # the dst or its folder
    assert named and any(r in err for r in reasons), err
    assert not os.path.exists(dst) and not crash.leftovers(dst), crash.leftovers(dst)


@pytest.mark.parametrize("command", ["import", "export"])
def test_disk_full_is_a_clear_error(src, tmp_path, command, capsys):
    """On a 256 KB tmpfs (ENOSPC) when mounting is allowed, else with RLIMIT_FSIZE (EFBIG)."""
    before = _digest(src)
    mnt = tmp_path / "small"
    with _tmpfs(mnt, "256k") as mounted:
        dst = str(mnt / "out")
        res = _run_cli(capsys, command, src, dst, "--quiet", fsize=None if mounted else 64 * 1024)
        _assert_clean_failure(res, dst, ("No space left on device", "File too large"))
    assert _digest(src) == before


WRITERS = ["hf", "dcp", "torchtitan", "megatron", "maxtext", "paddleformers-unified", "paddlenlp-unified"]


@pytest.mark.parametrize("size", ["16k", "256k"])
@pytest.mark.parametrize("target", WRITERS)
def test_disk_full_on_every_writer_is_one_line(src, tmp_path, target, size, capsys):
    """Every `export --to` writer, with its optimizer state, on a tmpfs that fills at its first
    files (16k) or among its arrays (256k): one line, exit 2, nothing left (`--to maxtext` was a
    traceback from TensorStore, then "Event loop is closed" at exit). Without the right to mount,
    RLIMIT_FSIZE (EFBIG) instead."""
    before = _digest(src)
    mnt = tmp_path / "small"
    with _tmpfs(mnt, size) as mounted:
        dst = str(mnt / "out")
        res = _run_cli(capsys, "export", src, dst, "--quiet", "--to", target, "--optimizer",
                       fsize=None if mounted else {"16k": 16 * 1024, "256k": 256 * 1024}[size],
                       child=target == "maxtext")
        _assert_clean_failure(res, dst, ("No space left on device", "File too large"))
        assert os.listdir(mnt) == []
    assert _digest(src) == before


@pytest.mark.parametrize("command", ["import", "export"])
def test_read_only_destination_is_a_clear_error(src, tmp_path, command, capsys):
    before = _digest(src)
    with _read_only(tmp_path / "ro") as code:
        dst = str(tmp_path / "ro" / "out")
        res = _run_cli(capsys, command, src, dst, "--quiet")
        _assert_clean_failure(res, dst, (os.strerror(code),))
    assert _digest(src) == before
