"""The sparse `paddle.save` writer of the Paddle scale sources (`benchmarks/paddle_pickle.py`)
writes paddle.save's bytes, and our reader opens such a file without touching its payloads:

- every `paddle.save` file of the real corpus (PaddleNLP 3.0.0b4's `.pdparams` / `.pdopt`,
  PaddleFormers 1.2.0's FlexCheckpoint `.distcp` files, state-dict form, paddle 3.0.0 / 3.3.1),
  rebuilt from what our reader finds in it with its own payload bytes, is the same file byte for
  byte;
- paddle 3.3.1's save of zero arrays of 64 KiB and more (written outside pickle's frames) and of
  an optimizer dict in `(name, ndarray)` form with `master_weights` (recorded by
  `tests/real/generators/paddle_save_layout.py`) has the SHA-256 of the writer's file whose
  payloads are holes (and not that of the same arrays pickled as numpy 2 names them);
- `paddle_save.read` of a file with a 1 GiB hole payload unpickles a few hundred bytes: the
  payload is a reference to its offset, never copied; and it walks the file's opcodes once (the
  restricted machine's pre-scan does not walk the same opcodes again: at 448 ranks that second
  walk was ~15% of opening a PaddleNLP hybrid checkpoint);
- opening a 16 MiB file of 32 payloads whose page cache was dropped reads about its headers'
  pages from the disk (the kernel's `read_bytes`), not the payloads the read-ahead of an mmap
  fault would bring in (the whole file without MADV_RANDOM; on a tmpfs nothing is read either way).
"""

import glob
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import paddle_pickle as pp  # noqa: E402

from hybridckpt.containers.pickle import opcodes, paddle_save  # noqa: E402
from hybridckpt.lazy import StoredTensor  # noqa: E402

REAL = os.path.join(os.path.dirname(__file__), "..", "real")
RECORD = os.path.join(REAL, "paddle_save_layout.json")


def _from_loaded(x, path):
    """What our reader found in a paddle.save file, as the writer's objects (payloads kept)."""
    if isinstance(x, np.ndarray):
        return pp.Array(x.shape, x.dtype.str[1:], x.tobytes())
    if isinstance(x, StoredTensor):
        with open(path, "rb") as f:
            f.seek(x.offset)
            data = f.read(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize)
        return pp.Array(x.shape, np.dtype(x.dtype).str[1:], data)
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
        return pp.Named(x[0], _from_loaded(x[1], path))
    if isinstance(x, dict):
        if pp.NAME_TABLE in x:
            table = x.pop(pp.NAME_TABLE)
            return pp.state_dict({k: _from_loaded(v, path) for k, v in x.items()}, table)
        return {k: _from_loaded(v, path) for k, v in x.items()}
    return x


def _from_record(s):
    """The writer's objects (no payload: holes) of a recorded structure."""
    if "array" in s:
        return pp.Array(s["array"], s["code"])
    if "named" in s:
        return pp.Named(s["named"], _from_record(s["value"]))
    if "dict" in s:
        items = dict(s["dict"])
        if pp.NAME_TABLE in items:
            table = {k: v["value"] for k, v in items.pop(pp.NAME_TABLE)["dict"]}
            return pp.state_dict({k: _from_record(v) for k, v in items.items()}, table)
        return {k: _from_record(v) for k, v in items.items()}
    return s["value"]


def test_real_corpus_files_are_rewritten_byte_for_byte(tmp_path):
    files = sorted(
        glob.glob(os.path.join(REAL, "cases", "paddle*", "ckpt", "*", "checkpoint-*", "*.pd*"))
        + glob.glob(os.path.join(REAL, "cases", "paddle*", "ckpt", "flex", "checkpoint-*", "*", "*.distcp"))
    )
    assert len(files) >= 25
    kinds = set()
    for f in files:
        out = str(tmp_path / "out")
        pp.dump(_from_loaded(paddle_save.safe_load(f), f), out)
        with open(f, "rb") as a, open(out, "rb") as b:
            assert a.read() == b.read(), f
        kinds.add(os.path.splitext(f)[1])
    assert kinds == {".pdparams", ".pdopt", ".distcp"}


def test_zero_payloads_are_paddle_saves_with_holes(tmp_path):
    with open(RECORD) as f:
        record = json.load(f)
    assert record["paddle"] == "3.3.1"
    for name, want in record["files"].items():
        out = str(tmp_path / name)
        got = pp.dump(_from_record(want["structure"]), out)
        assert got["bytes"] == want["bytes"] == os.path.getsize(out)
        assert got["holes"] >= 64 * 1024  # payloads past the frame target were skipped, not written
        with open(out, "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == want["sha256"], name
        # the same arrays as numpy 2 pickles them (`numpy._core.multiarray`): not these bytes
        pp.dump(_from_record(want["structure"]), out, numpy_core="numpy._core")
        with open(out, "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() != want["sha256"]


def test_reader_skips_hole_payloads(tmp_path, monkeypatch):
    path = str(tmp_path / "big.pdparams")
    obj = pp.state_dict({"w": pp.Array((2**28,), "f4"), "b": pp.Array((4,), "f4", bytes(16))},
                        {"w": "linear_0.w_0", "b": "linear_0.b_0"})
    info = pp.dump(obj, path)
    assert info["holes"] == 2**30 and os.stat(path).st_blocks * 512 < 2**20  # sparse
    unpickled, walks = [], []
    real, real_scan = paddle_save.safe_loads, opcodes.scan_pickle

    def counting(stream, *a, **k):
        unpickled.append(len(stream))
        return real(stream, *a, **k)

    def counting_walk(*a, **k):
        walks.append(1)
        return real_scan(*a, **k)

    monkeypatch.setattr(paddle_save, "safe_loads", counting)
    monkeypatch.setattr(paddle_save, "scan_pickle", counting_walk)
    monkeypatch.setattr(opcodes, "scan_pickle", counting_walk)  # check_pickle's walk
    d = paddle_save.read(path)
    assert isinstance(d.tensors["w"], StoredTensor) and d.tensors["w"].shape == (2**28,)
    assert d.names == {"w": "linear_0.w_0", "b": "linear_0.b_0"}
    assert unpickled and max(unpickled) < 1024  # the 1 GiB payload stays in the file
    assert len(walks) == 1  # one opcode walk of the file; none again of the rewritten stream


def _disk_reads() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def test_opening_reads_no_payload_from_disk(tmp_path):
    path = str(tmp_path / "f.pdparams")
    arrays = {f"w{i}": pp.Array((128 * 1024,), "f4", bytes([i + 1]) * (512 * 1024)) for i in range(32)}
    pp.dump(pp.state_dict(arrays, {k: f"linear_{k}.w_0" for k in arrays}), path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
    finally:
        os.close(fd)
    before = _disk_reads()
    d = paddle_save.read(path)
    assert _disk_reads() - before < 2**20  # 16 MiB with the read-ahead; ~132 KiB without
    assert len(d.tensors) == 32 and all(isinstance(t, StoredTensor) for t in d.tensors.values())
