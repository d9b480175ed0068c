"""The benchmarks' baselines (`benchmarks/floors.py`, `benchmarks/kernel_io.py`,
`benchmarks/fresh_floors.py`): the O_DIRECT write floor writes the bytes it times, the
fresh-memory read floors read every byte they time, each way, each in its own process in the
restore's state and after the same preparation as the restore beside them, and the kernel's count
of bytes read agrees with a count that is right and flags one that is not."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import floors  # noqa: E402
import fresh_floors  # noqa: E402
import kernel_io  # noqa: E402
import pytest  # noqa: E402
from fixtures.direct_probe import direct_supported  # noqa: E402


def _files(tmp_path, sizes):
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"src{i}"
        p.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        paths.append(str(p))
    return paths


def test_direct_floor_writes_the_same_files_or_says_why(tmp_path, monkeypatch):
    paths = _files(tmp_path, [(9 << 20) + 123, 4096, 777])  # a partial last block, whole blocks, < 1 block
    out = tmp_path / "out"
    kept = {}
    real_rmtree = floors.shutil.rmtree

    def keep(path, ignore_errors=False):  # read the copies before the floor removes them
        if os.path.isdir(path) and os.listdir(path):
            kept.update({f: (out / f).read_bytes() for f in os.listdir(path)})
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(floors.shutil, "rmtree", keep)
    secs, note = floors.direct_write_floor(paths, str(out))
    if not direct_supported(str(tmp_path)):
        assert secs is None and "refused" in note
        return
    assert secs > 0 and note == "O_DIRECT"
    assert [kept[f"{i}-src{i}"] for i in range(3)] == [open(p, "rb").read() for p in paths]
    part, _ = floors.direct_write_floor(paths, str(out), nbytes=5 << 20)  # the job writes less
    assert part is not None and len(kept["0-src0"]) == 5 << 20


def test_queued_direct_floor_writes_the_same_bytes_from_several_threads(tmp_path, monkeypatch):
    """`queued_direct_write_floor` (the O_DIRECT floor with writes queued, as an import's writers
    keep them): every source byte written once, in pieces of `piece` bytes (files `i-k-name`),
    a piece's unaligned tail included; the job's `nbytes` bounds it; refused O_DIRECT says so."""
    paths = _files(tmp_path, [(9 << 20) + 123, 4096, 777])
    out = tmp_path / "out"
    kept = {}
    real_rmtree = floors.shutil.rmtree

    def keep(path, ignore_errors=False):
        if os.path.isdir(path) and os.listdir(path):
            kept.update({f: (out / f).read_bytes() for f in os.listdir(path)})
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(floors.shutil, "rmtree", keep)
    secs, note = floors.queued_direct_write_floor(paths, str(out), threads=3, piece=4 << 20)
    if not direct_supported(str(tmp_path)):
        assert secs is None and "refused" in note
        return
    assert secs > 0 and "queued" in note
    for i, p in enumerate(paths):
        pieces = sorted((int(f.split("-")[1]), b) for f, b in kept.items() if f.startswith(f"{i}-"))
        assert b"".join(b for _, b in pieces) == open(p, "rb").read(), p
    assert len([f for f in kept if f.startswith("0-")]) == 3  # (9 MiB + 123 B in 4 MiB pieces)
    kept.clear()
    part, _ = floors.queued_direct_write_floor(paths, str(out), nbytes=5 << 20, piece=4 << 20)
    assert part is not None and sum(map(len, kept.values())) == 5 << 20
    fl = floors.measure(paths, str(out), repeat=1)
    assert fl["write_direct_s"] == min(fl["write_direct_serial_s"], fl["write_direct_queued_s"])
    by_piece = fl["write_direct_queued_by_mib"]  # the queued way at each file size, the floor its fastest
    assert sorted(by_piece) == sorted(p >> 20 for p in floors.QUEUED_PIECES) and len(floors.QUEUED_PIECES) > 1
    assert fl["write_direct_queued_s"] == min(by_piece.values())


def test_kernel_count_matches_reads_on_a_cold_cache(tmp_path):
    (path,) = _files(tmp_path, [16 << 20])
    note = kernel_io.drop_cache([path])
    before = kernel_io.proc_io()
    with open(path, "rb") as f:
        got = len(f.read())
    check = kernel_io.cross_check(got, kernel_io.delta(before, kernel_io.proc_io()), note)
    assert check["ok"], check


def test_a_wrong_library_count_is_flagged():
    kernel = {"read_bytes": 100 << 20, "rchar": 100 << 20}
    assert kernel_io.cross_check(100 << 20, kernel)["ok"]
    bad = kernel_io.cross_check(50 << 20, kernel)
    assert not bad["ok"] and "2.000x" in bad["why"]
    warm = kernel_io.cross_check(50 << 20, {"read_bytes": 0, "rchar": 50 << 20})  # cache not dropped
    assert warm["ok"] and warm["source"].startswith("rchar")


@pytest.mark.parametrize("direct", [False, True], ids=["cached", "direct"])
def test_fresh_floor_reads_every_byte_each_way(tmp_path, direct):
    """Each way of the restore's fresh-memory floor (1, 2 or 4 threads; 4 KiB pages populated or
    faulted in by the read, or huge pages; cached or O_DIRECT) holds every file's bytes at the
    end: a partial last block, whole blocks, less than a block, an empty file."""
    paths = _files(tmp_path, [(9 << 20) + 123, 8192, 777, 0, 5 << 20])
    if direct and not direct_supported(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT (the floor says so and stops)")
    want = [open(p, "rb").read() for p in paths]
    for threads in fresh_floors.FLOOR_THREADS:
        for pages in fresh_floors.FLOOR_PAGES:
            secs, held = fresh_floors.fresh_read(paths, threads, pages, direct)
            assert secs > 0 and [b.tobytes() for b in held] == want, (threads, pages)
            assert all(b.ctypes.data % 4096 == 0 for b in held if b.size)


def test_fresh_floor_stops_on_a_missing_file(tmp_path):
    paths = _files(tmp_path, [4096, 4096])
    os.remove(paths[1])
    with pytest.raises(FileNotFoundError):
        fresh_floors.fresh_read(paths, 2, "small", False)


def test_a_round_runs_each_way_and_the_restore_in_turn_each_prepared_alike(tmp_path, monkeypatch):
    """`measured_round` runs every way of threads x pages and the restore, each after the same
    preparation (warm: the files read; cold: their pages dropped), the restore's place turned by
    `turn`; the strict floor is the fastest way, the 4 KiB-page floor the fastest of 4 KiB pages."""
    paths = _files(tmp_path, [1 << 20, 12345])
    log = []
    monkeypatch.setattr(fresh_floors, "prepare", lambda p, direct: log.append(("prepare", direct)))
    fake = {(t, p): 1.0 + t + {"small": 0.5, "fault": 0.25, "block": 0.375, "huge": 0.0}[p]
            for t in fresh_floors.FLOOR_THREADS for p in fresh_floors.FLOOR_PAGES}
    monkeypatch.setattr(fresh_floors, "way_seconds", lambda listed, t, p, d: log.append((t, p)) or fake[t, p])
    n = len(fake)
    for turn in (0, 1, n, n + 3):
        log.clear()
        got, ways = fresh_floors.measured_round(paths, direct=True, turn=turn,
                                                restore=lambda: log.append("restore") or {"job_s": 0.5})
        runs = [x for x in log if x[0] != "prepare"]
        assert got == {"job_s": 0.5} and ways == fake
        assert runs.index("restore") == turn % (n + 1) and len(runs) == n + 1
        assert log[0::2] == [("prepare", True)] * (n + 1)  # each run prepared, cold: pages dropped
    assert fresh_floors.fastest(ways) == 2.0 and fresh_floors.fastest_small(ways) == 2.25
    seen = fresh_floors.WAYS_SEEN[-1]
    assert seen["direct"] is True and len(seen["seconds"]) == n


def test_each_way_runs_in_its_own_process_with_the_restores_modules_loaded(tmp_path):
    """`way_seconds` runs a way in a fresh process that first loads what a restore's process
    loads (the same process state as the restore it is compared with), and the round's warm
    preparation reads the files."""
    import json

    paths = _files(tmp_path, [1 << 20, 12345])
    listed = tmp_path / "files.json"
    listed.write_text(json.dumps(paths))
    assert fresh_floors.way_seconds(str(listed), 2, "fault", False) > 0
    probe = f"""
import sys
sys.path.insert(0, {os.path.dirname(fresh_floors.__file__)!r})
import fresh_floors
real = fresh_floors.fresh_read
def spy(*a):
    print(all(m in sys.modules for m in ("jax", "optax", "hybridckpt.jobs.restore", "hybridckpt.place")))
    return real(*a)
fresh_floors.fresh_read = spy
fresh_floors.main()
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", probe, "--_way", str(listed), "1", "small", "cached"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded, secs = out.stdout.split()[-2:]
    assert loaded == "True" and float(secs) > 0  # the restore's modules loaded before the timed reads
    fresh_floors.prepare(paths, direct=False)  # (reads every file once: no error on a short file)


def test_a_restores_seconds_leave_out_the_modules_it_loads_on_first_use(tmp_path):
    """`restore_floor.child` times a restore after `fresh_floors.load_restore_modules`: a restore of params
    and AdamW state then loads no module of JAX, optax, Orbax, TensorStore or the library (the
    ninth and tenth stops' restores counted optax's import, ~32 ms) and finds JAX's backend
    started (until the fourteenth stop each restore started it: 8-11 ms)."""
    import json
    import subprocess

    from hybridckpt.demo import sample_path
    from hybridckpt.jobs.import_ import import_checkpoint

    ck = str(tmp_path / "ck")
    import_checkpoint(sample_path(), ck, mesh="fsdp=2")  # (params and AdamW moments)
    code = f"""
import json, sys
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")!r})
import fresh_floors
fresh_floors.devices()
if sys.argv[1] == "loaded":
    fresh_floors.load_restore_modules()
import hybridckpt
from jax._src import xla_bridge
started = xla_bridge.backends_are_initialized()
before = set(sys.modules)
_, r = hybridckpt.restore({ck!r}, "fsdp=1")
assert r.opt_state is not None
heavy = ("jax", "jaxlib", "optax", "orbax", "tensorstore", "hybridckpt", "flax", "models")
print(started, json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in heavy)))
"""
    got = {}
    for how in ("loaded", "bare"):
        out = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        started, listed = out.stdout.strip().splitlines()[-1].split(" ", 1)
        got[how] = started == "True", json.loads(listed)
    assert got["loaded"] == (True, []), got["loaded"]  # JAX's backend started, nothing left to load
    assert got["bare"][0] is False  # (the restore would start it: 8-11 ms of a 1.1 GB warm restore)
    assert any(m.startswith("optax") for m in got["bare"][1]), got["bare"]  # what the preload takes out of the timing


def test_the_orbax_peer_restores_what_our_restore_does_bit_for_bit(tmp_path):
    """`orbax_peer`: Orbax's own restore of our store onto the targets of our plan (the restore
    benchmarks' peer) gives the arrays our restore gives, params and AdamW state, on another mesh,
    with the same shardings; and what it times is Orbax's restore alone, not the plan."""
    import jax
    import orbax_peer

    import hybridckpt
    from hybridckpt.demo import sample_path
    from hybridckpt.jobs.import_ import import_checkpoint

    ck = str(tmp_path / "ck")
    import_checkpoint(sample_path(), ck, mesh="fsdp=2")
    mesh = "tp=2" if len(jax.devices()) >= 2 else "fsdp=1"
    _, ours = hybridckpt.restore(ck, mesh)
    step, items = orbax_peer.targets(ck, mesh)
    assert step == ours.step and set(items) == {"params", "opt_state"}
    theirs = orbax_peer.orbax_restore(ck, step, items)
    for mine, peer in ((ours.params, theirs["params"]), (ours.opt_state, theirs["opt_state"])):
        a, b = jax.tree_util.tree_leaves_with_path(mine), jax.tree.leaves(peer)
        assert len(a) == len(b) > 0
        for (path, x), y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), path
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path


_BACKED = """
import os, sys
sys.path.insert(0, {bench!r})
import numpy as np
import fresh_floors
if sys.argv[1] == "reset":
    assert fresh_floors.back_memory(256 << 20)
else:  # (the control: the same bytes touched, the peak not reset)
    b = np.ones(256 << 20, np.uint8)
    del b
c = np.ones(16 << 20, np.uint8)  # (what the measured run fills after)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="no /proc/self/clear_refs (not Linux)")
def test_backing_a_runs_memory_leaves_it_out_of_the_runs_peak_rss(tmp_path):
    """`fresh_floors.back_memory`: each measured process (a floor way, our restore, Orbax's) first
    touches and gives back as many bytes as it will fill, so that all take memory the host backs;
    the peak RSS the benchmark's launcher reports (`wait4`) is then the run's own, not the
    backing's (without the reset it would be: the control)."""
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    script = tmp_path / "backed.py"
    script.write_text(_BACKED.format(bench=os.path.abspath(bench)))
    import import_sources_floor

    peak = {}  # MiB, as the benchmark's launcher reports a run's (`wait4` of a small process's child)
    for how in ("reset", "control"):
        peak[how] = import_sources_floor.launch([sys.executable, str(script), how], how)[0]["peak_rss_mib"]
    assert peak["control"] > 256  # (the backing shows in a peak not reset)
    assert peak["reset"] < 200, peak  # (the run's 16 MiB and the interpreter's modules)


def test_the_benchmarks_restore_records_why_a_round_was_slow(tmp_path):
    """`import_sources_floor.restore_child` (each restore of the 4 GiB sources' benchmark, in a
    fresh process with its memory backed) returns, beside its seconds and bytes, its user and
    system CPU seconds, its page faults and the machine's CPU seconds by kind (IO wait, steal), so
    that a round slower than the rest says whether it was the faults, the disk or the host."""
    import json
    import subprocess

    from hybridckpt.demo import sample_path
    from hybridckpt.jobs.import_ import import_checkpoint

    ck = str(tmp_path / "ck")
    import_checkpoint(sample_path(), ck, mesh="fsdp=1")
    bench = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    code = f"""
import json, sys
sys.path.insert(0, {bench!r})
import import_sources_floor as m
m.RESTORE_MESH = "fsdp=1"
r = m.restore_child({ck!r})
r.pop("profile")
print(json.dumps(r))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["placed_bytes"] == r["read_bytes"] > 0 and r["job_s"] > 0
    assert r["minor_faults"] > 0 and r["major_faults"] >= 0 and r["user_s"] + r["system_s"] > 0
    import import_sources_floor

    assert set(import_sources_floor.RUN_CPU_FIELDS) <= set(r) | {"job_s"}
    assert {"machine_iowait_s", "machine_steal_s"} <= set(r)


def test_each_import_is_paired_with_the_floor_written_just_before_it(tmp_path, monkeypatch):
    """`import_sources_floor.bench_import` writes one queued O_DIRECT floor just before each
    import, so each pair sees the same disk (this VM's writes take 20-50% longer under
    sustained writes), and reports the median of the per-pair ratios beside the strict ratio to the run's
    best floor."""
    import import_sources_floor as m

    events = []

    def write(path, gib):
        os.makedirs(path)
        (tmp_path / "dcp" / "f").write_bytes(b"x" * 4096)
        return {"writer": "w", "layers": 1, "config": None}

    adjacent = iter([2.0, 4.0, 1.0])

    def queued(paths, out_dir, nbytes=None, threads=4, piece=8 << 20):
        events.append(("floor", s := next(adjacent)))
        return s, "queued"

    jobs = iter([9.0, 3.0, 5.0, 1.5])  # (the first: the warm-up, not counted)

    def run_import(src, dst, cfg, tree=None):
        events.append(("import", s := next(jobs)))
        return {"job_s": s, "wall_s": s + 1, "bytes": 4096, "tensors": 1, "profile": None, "cpu_s": 1.0,
                "peak_rss_mib": 1}

    strict = {"write_direct_s": 1.0, "write_direct_serial_s": 1.2, "write_direct_queued_s": 1.0,
              "write_direct_queued_by_mib": {8: 1.0}, "write_s": 3.0}
    monkeypatch.setitem(m.WRITERS, "dcp", write)
    monkeypatch.setattr(m.floors, "queued_direct_write_floor", queued)
    monkeypatch.setattr(m.floors, "measure", lambda paths, scratch, write_bytes=None: strict)
    monkeypatch.setattr(m, "run_import", run_import)
    monkeypatch.setattr(m, "_account", lambda run: {"account_over_process_wall": 1.0, "busy_s": {}})
    row, _ = m.bench_import("dcp", str(tmp_path), 0.001, 3, keep_ck=False, quiet=True)
    assert events == [("import", 9.0), ("floor", 2.0), ("import", 3.0), ("floor", 4.0), ("import", 5.0),
                      ("floor", 1.0), ("import", 1.5)]
    assert row["adjacent_floors_s"] == [2.0, 4.0, 1.0]
    assert row["job_over_adjacent_floor"] == 1.5  # (median of 1.5, 1.25, 1.5)
    assert row["job_over_floor"] == 3.0  # (the strict figure: the median import over the run's best floor)
