"""Files that change while a job reads them (issue 38): never zeros, never a mix of two versions.

A safetensors file written by the safetensors library is truncated, extended, truncated and extended again
(the missing bytes would read as zeros), or replaced by another file in the middle of a real
import or export, by a hook on the project's own reader (`ByteSource.read_into`, called from the
reader threads) after its first tensor read: the job is one line naming the file and the change,
exit 2, and nothing is committed or left beside the destination. A file rewritten between two
jobs of one process is read as it is then (its cached descriptor is not reused when the path now
names another file), and is no error.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hybridckpt.cli import main
from hybridckpt.errors import FormatError
from hybridckpt.io import byte_source
from hybridckpt.io.byte_source import ByteSource, close_all

A = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) * 0.25
B = np.full((64, 64), 3.0, np.float32)


def _source(root) -> tuple[str, str]:
    src = os.path.join(root, "src")
    os.makedirs(src)
    path = os.path.join(src, "model.safetensors")
    save_file({"a.weight": A, "b.weight": B}, path, {"format": "pt"})
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({"architectures": ["HostileForCausalLM"], "model_type": "hostile"}, f)
    return src, path


def _data_start(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _on_first_data_read(monkeypatch, path: str, action) -> list:
    """Run `action()` once, just after the first read of a tensor's bytes of `path`."""
    start, done, orig = _data_start(path), [], ByteSource.read_into

    def read_into(self, offset, buffer):
        orig(self, offset, buffer)
        if self.path == path and offset >= start and not done:
            done.append(offset)
            action()

    monkeypatch.setattr(ByteSource, "read_into", read_into)
    return done


def _cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    close_all()
    return code, capsys.readouterr().err


def _shrink(path):
    return lambda: os.truncate(path, os.path.getsize(path) - 8192)


def _shrink_and_grow(path):
    size = os.path.getsize(path)

    def act():  # the file's last 8 KiB now read as zeros, its size the same at every moment: a
        # truncate and regrow left a window in which another reader thread saw the shorter size
        # (CI once saw "size 32952 -> 24760", not the same-size rewrite this case is about)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\0" * 8192, size - 8192)
        finally:
            os.close(fd)
    return act


def _extend(path):
    def act():
        with open(path, "ab") as f:
            f.write(b"\0" * 48)  # a writer still appending
    return act


def _replace(path):
    def act():
        other = path + ".new"
        save_file({"a.weight": A + 1, "b.weight": B + 1}, other, {"format": "pt"})
        os.replace(other, path)
    return act


@pytest.mark.parametrize(("how", "change"), [
    (_shrink, "size 32952 -> 24760"),
    (_shrink_and_grow, "rewritten at the same size 32952"),
    (_extend, "size 32952 -> 33000"),
    (_replace, "replaced by another file"),
])
@pytest.mark.parametrize("job", ["import", "export"])
def test_a_source_that_changes_during_a_job_is_one_line_and_nothing_is_committed(
    tmp_path, capsys, monkeypatch, how, change, job
):
    src, path = _source(tmp_path)
    assert os.path.getsize(path) == 32952  # the sizes the messages name
    dst = tmp_path / "dst"
    done = _on_first_data_read(monkeypatch, path, how(path))
    code, err = _cli(capsys, job, src, dst)
    assert done  # the file did change in the middle of the job
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    assert f"{path} changed while it was read: {change}" in err, err
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no dst, no .lock, no .tmp-*


def test_verify_of_a_file_that_changes_while_compared_is_one_line(tmp_path, capsys, monkeypatch):
    """A verdict on bytes of two versions is no verdict: `verify` A B where A is rewritten (same
    size, zeros in the middle) after its first tensor was compared."""
    src, path = _source(tmp_path)
    twin = tmp_path / "twin"
    shutil.copytree(src, twin)
    _on_first_data_read(monkeypatch, path, _shrink_and_grow(path))
    code, err = _cli(capsys, "verify", src, twin)
    assert code == 2, err
    assert err.count("\n") == 1 and f"{path} changed while it was read: rewritten at the same size 32952" in err, err

def test_a_file_shrunk_after_its_last_read_is_caught_before_the_commit(tmp_path, capsys, monkeypatch):
    """Every tensor already read when the file shrinks: no read is short, the check after the last
    read is what refuses the job."""
    src, path = _source(tmp_path)
    start, orig, reads = _data_start(path), ByteSource.read_into, []

    def read_into(self, offset, buffer):
        orig(self, offset, buffer)
        if self.path == path and offset >= start:
            reads.append(offset)
            if len(reads) == 2:  # both tensors read
                os.truncate(path, start)

    monkeypatch.setattr(ByteSource, "read_into", read_into)
    code, err = _cli(capsys, "import", src, tmp_path / "dst")
    assert len(reads) == 2 and code == 2, err
    assert f"{path} changed while it was read: size 32952 -> {start}" in err, err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_short_read_names_the_change(tmp_path):
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 64)
    src = ByteSource(path)
    try:
        assert src.read(0, 4) == bytes([0, 1, 2, 3])
        os.truncate(path, 1000)
        with pytest.raises(FormatError, match=r"f\.bin changed while it was read: size 16384 -> 1000$"):
            src.read(900, 200)
        with pytest.raises(FormatError, match=r"changed while it was read: size 16384 -> 1000$"):
            src.read_runs(np.array([0, 4000]), 8, memoryview(bytearray(16)))
    finally:
        close_all()


def test_a_folder_rewritten_between_two_jobs_of_one_process_is_read_as_it_is_then(tmp_path, capsys):
    """No error, and no stale descriptor: the second import reads the new file's values."""
    src, path = _source(tmp_path)
    assert main(["import", src, str(tmp_path / "one")]) == 0
    other = path + ".new"
    save_file({"a.weight": A * 2, "b.weight": B * 2}, other, {"format": "pt"})
    os.replace(other, path)  # a new file under the same name (the old one stays open in our cache)
    assert main(["import", src, str(tmp_path / "two")]) == 0
    for name, scale in (("one", 1), ("two", 2)):
        assert main(["export", str(tmp_path / name), str(tmp_path / f"{name}-hf")]) == 0
        got = load_file(str(tmp_path / f"{name}-hf" / "model.safetensors"))
        np.testing.assert_array_equal(got["a.weight"], A * scale)
        np.testing.assert_array_equal(got["b.weight"], B * scale)
    close_all()


def test_the_check_costs_no_syscall_per_read(tmp_path, monkeypatch):
    """One fstat when a job first reads a file, one fstat and one stat after: none per read."""
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(bytes(1 << 16))
    calls = []
    for name in ("fstat", "stat"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    try:
        with byte_source.watch() as w:
            src = ByteSource(path)
            for i in range(100):
                src.read(i * 256, 256)
            opened = list(calls)
            w.check()
        assert opened == ["fstat"]  # at open (which is the job's first read of it)
        assert calls[len(opened):] == ["fstat", "stat"]
        with byte_source.watch() as w:  # a later job: the cached descriptor, checked once
            for i in range(100):
                src.read(i * 256, 256)
        assert calls[len(opened) + 2:] == ["fstat", "stat"]
    finally:
        close_all()


# -- Paddle pickles: walked by pread, never through a mapping ------------------------------------

PADDLE = os.path.join(os.path.dirname(__file__), "..", "real", "cases", "paddlenlp_untied_fp32_1rank", "ckpt",
                      "legacy", "checkpoint-3")
_TRUNCATE_DURING_THE_WALK = """
import os, sys
from hybridckpt.cli import main
from hybridckpt.containers.pickle import paddle_save
target, real = sys.argv[2], paddle_save.scan_pickle
def scan(data, *args, **kwargs):
    if kwargs.get("what") == target:
        os.truncate(target, 4096)  # under the walk: its next page is past the end
    return real(data, *args, **kwargs)
paddle_save.scan_pickle = scan
sys.exit(main(["inspect", sys.argv[1]]))
"""


def test_a_pdparams_truncated_during_the_opcode_walk_is_one_line_not_a_sigbus(tmp_path):
    """paddle 3.0's own `.pdparams` (tests/real), truncated by a hook just as the walk starts: a
    mapped walk died of SIGBUS (exit -7, no message); preads make it the one line, exit 2."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "ckpt"
    shutil.copytree(PADDLE, folder)
    target = str(folder / "model_state.pdparams")
    assert os.path.getsize(target) == 62113
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_DURING_THE_WALK, str(folder), target],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr == f"hybridckpt: error: {target} changed while it was read: size 62113 -> 4096\n"


def test_a_pdparams_rewritten_after_its_walk_is_refused(tmp_path, monkeypatch):
    """Changed after the walk read its opcodes (same size, new bytes): the stream unpickled would
    mix two versions; the check after the walk refuses it."""
    import shutil

    from hybridckpt.containers.pickle import paddle_save

    folder = tmp_path / "ckpt"
    shutil.copytree(PADDLE, folder)
    target = str(folder / "model_state.pdparams")
    real = paddle_save.scan_pickle

    def scan(data, *args, **kwargs):
        found = real(data, *args, **kwargs)
        with open(target, "r+b") as f:
            f.write(b"\x80")  # the same byte, but a write: a new mtime
        return found

    monkeypatch.setattr(paddle_save, "scan_pickle", scan)
    os.utime(target, ns=(0, 0))  # an mtime the write cannot keep
    with pytest.raises(FormatError, match=r"model_state\.pdparams changed while it was read: rewritten at the same "
                                          r"size 62113 \(mtime 0 -> "):
        paddle_save.safe_load(target)


def test_a_pread_view_reads_as_bytes_do(tmp_path):
    """Indexing, slicing and find agree with the file's bytes, across windows and after jumps."""
    from hybridckpt.io.pread_view import MAX_WINDOW, PreadView

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 3 * MAX_WINDOW + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    with PreadView(str(path)) as v:
        assert len(v) == len(data) and v[-1] == data[-1]
        for a in rng.integers(0, len(data), 300).tolist():
            b = a + int(rng.integers(0, 2 * MAX_WINDOW))
            assert v[a] == data[a] and v[a:b] == data[a:b]
            assert v.find(b"\n", a) == data.find(b"\n", a)
            assert v.find(b"\xff\xfe", a) == data.find(b"\xff\xfe", a)
        assert v.find(b"no such bytes here", 0) == -1
        with pytest.raises(IndexError):
            v[len(data)]
        v.check_unchanged()
