"""`import --plan` (`jobs.plan_report`): the plan of an import equals what the import then reads.

On three real-tool checkpoints (torchtitan 0.3.0's DCP, dense and MoE, Megatron-Core's torch_dist) and a 2- and a
4-device mesh: the import is run with one reader thread and each tile it reads is counted
(`io.byte_source.count_reads` around the save's own `stream.read_tile`); per device (the owner
of each tile's box), the bytes, preads, gaps and files are exactly those of the plan, and the
bytes written sum to the arrays' bytes (each distinct box written once, by its owner). A plan of
other tiles (smaller chunks) differs from the import, and the comparison says so. `--plan` writes
nothing at the destination.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import jax
import pytest
from meshes import fit

from hybridckpt.cli import main
from hybridckpt.io.byte_source import close_all, count_reads
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.jobs.plan_report import ImportPlan, _tally, inside, plan_import
from hybridckpt.lazy import parallel
from hybridckpt.plan import box_owners
from hybridckpt.store import stream

CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real", "cases")
SOURCES = {  # case -> (checkpoint, config)
    "dcp": (os.path.join(CASES, "torchtitan_llama3", "ckpt", "step-3"),
            os.path.join(CASES, "torchtitan_llama3", "config.json")),
    "megatron": (os.path.join(CASES, "megatron_core_dense_dp_reshardable", "ckpt"), None),
    # torchtitan's MoE: each expert a reshaped slice of its layer's [experts, ...] chunks (DeepSeek V3's layout)
    "dcp_moe": (os.path.join(CASES, "torchtitan_qwen3_moe", "ckpt", "step-3"),
                os.path.join(CASES, "torchtitan_qwen3_moe", "config.json")),
}
MESHES = ("fsdp=2", "fsdp=2,tp=2")


def _imported_reads(monkeypatch, src: str, dst: str, mesh: str, config) -> dict[int, dict]:
    """Per owning device id: the reads the import made for its tiles (one reader thread)."""
    per: dict[int, dict] = {}
    lock = threading.Lock()
    real = stream.read_tile

    real_tiles = stream.box_tiles

    def owner_of(leaf, box):  # the lowest device of the joined box (`stream.joined_boxes`) holding the tile
        dev = box_owners(leaf.shape, leaf.sharding)
        joined = next(j for j in stream.joined_boxes(list(dev)) if inside(box, j))
        return dev[min(b for b in dev if inside(b, joined))]

    def add(leaf, box, c, written):
        with lock:
            d = per.setdefault(owner_of(leaf, box).id, {"counter": Counter(), "written": 0})
            d["counter"].update(c)
            d["written"] += written

    def counted(leaf, box, chunk, *rest):
        with count_reads(this_thread=True) as c:  # the reader thread's reads: this tile's
            out = real(leaf, box, chunk, *rest)
        add(leaf, box, c, out.nbytes)
        return out

    def probed(leaf, box, *args):  # the tiles' probe: headers parsed on first use, as the plan counts them
        with count_reads(this_thread=True, planned_too=False) as c:
            out = real_tiles(leaf, box, *args)
        add(leaf, box, c, 0)
        return out

    monkeypatch.setattr(stream, "read_tile", counted)
    monkeypatch.setattr(stream, "box_tiles", probed)
    parallel.set_io_threads(1)  # one tile read at a time: each counter sees only its tile
    try:
        close_all()
        import_checkpoint(src, dst, mesh=mesh, config=config)
    finally:
        parallel.set_io_threads(None)
    return per


def _mismatches(plan: ImportPlan, imported: dict[int, dict]) -> list[str]:
    """What differs between a plan and an import's reads, per device (empty: they agree)."""
    out = []
    planned = {d.device: d for d in plan.devices}
    for dev in sorted(set(planned) | set(imported)):
        p, i = planned.get(dev), imported.get(dev)
        got = (p.bytes_read, p.reads, p.gap_bytes, set(p.files), p.bytes_written) if p else None
        want = None
        if i is not None:
            nbytes, calls, gaps, paths = _tally(i["counter"])
            want = (nbytes, calls, gaps, paths, i["written"])
        if got != want:
            out.append(f"device {dev}: plan {got} != import {want}")
    return out


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_plan_equals_what_the_import_reads_per_device(monkeypatch, tmp_path, source, mesh):
    src, config = SOURCES[source]
    mesh = fit(mesh)
    plan = plan_import(src, mesh=mesh, config=config)
    imported = _imported_reads(monkeypatch, src, str(tmp_path / "out"), mesh, config)
    assert _mismatches(plan, imported) == []
    assert sum(d.bytes_read for d in plan.devices) > 0 and sum(d.reads for d in plan.devices) > 0
    # each distinct box is read and written once, by its owner: the devices' bytes add up to the arrays'
    assert sum(d.bytes_written for d in plan.devices) == plan.tensor_bytes
    assert [p.bytes_read for p in plan.processes] == [sum(d.bytes_read for d in plan.devices)]


def test_a_wrong_plan_is_caught(monkeypatch, tmp_path):
    """A plan of other tiles (1 KiB chunks and tiles instead of the import's 8 MiB, kept at 1 KiB by
    a 2 KiB in-flight budget: short reads grow a tile to half of it at most) reads the same bytes
    in more preads: the comparison names the devices that differ."""
    src, config = SOURCES["dcp"]
    mesh = fit("fsdp=2")
    wrong = plan_import(src, mesh=mesh, config=config, stream_options=stream.StreamOptions(
        tile_bytes=1 << 10, chunk_bytes=1 << 10, inflight_bytes=2 << 10))  # tiles that may not grow
    imported = _imported_reads(monkeypatch, src, str(tmp_path / "out"), mesh, config)
    bad = _mismatches(wrong, imported)
    assert bad and all("plan" in line for line in bad)
    assert sum(d.bytes_read for d in wrong.devices) == sum(_tally(i["counter"])[0] for i in imported.values())


def test_cli_plan_writes_nothing_and_prints_json(tmp_path, capsys):
    src, config = SOURCES["dcp"]
    dst = tmp_path / "out"
    mesh = fit("fsdp=2")
    assert main(["import", src, str(dst), "--mesh", mesh, "--config", config, "--plan", "--json"]) == 0
    assert not dst.exists() and os.listdir(tmp_path) == []
    got = json.loads(capsys.readouterr().out)
    plan = plan_import(src, mesh=mesh, config=config)
    assert got["devices"] == [json.loads(json.dumps(d)) for d in plan.to_json()["devices"]]
    assert main(["inspect", src, "--plan", "--mesh", mesh, "--config", config]) == 0
    text = capsys.readouterr().out
    assert "bytes read" in text and f"device {plan.devices[0].device}" in text


def test_plan_of_one_of_ours_equals_its_reimport(monkeypatch, tmp_path):
    """An Orbax source is read through its CRC-32 checks (`store.checked`), which a plan's dry
    reads pass without comparing: the plan of a reimport onto another mesh equals its reads."""
    src, _ = SOURCES["megatron"]
    first = str(tmp_path / "first")
    import_checkpoint(src, first, mesh=fit("fsdp=2"))
    mesh = fit("fsdp=2,tp=2", keep="tp")
    plan = plan_import(first, mesh=mesh)
    imported = _imported_reads(monkeypatch, first, str(tmp_path / "second"), mesh, None)
    assert _mismatches(plan, imported) == []
    assert sum(d.reads for d in plan.devices) > 0


def test_plan_of_one_process_of_many(capsys):
    """`--processes N --process P`: the devices split over N processes in order (as N hosts hold
    them); one process's plan is exactly the whole plan's devices of that process, the processes
    together are the whole plan, and each process reads a share of the bytes."""
    import jax

    src, config = SOURCES["dcp"]
    n = jax.device_count()
    mesh = fit("fsdp=8")
    whole = plan_import(src, mesh=mesh, config=config, processes=n)
    assert [p.process for p in whole.processes] == sorted({d.process for d in whole.devices})
    assert {d.device: d.process for d in whole.devices} == {
        d.id: i for i, d in enumerate(jax.devices()) if d.id in {x.device for x in whole.devices}}
    for p in whole.processes:
        one = plan_import(src, mesh=mesh, config=config, process=p.process, processes=n)
        mine = tuple(d for d in whole.devices if d.process == p.process)
        key = lambda d: (d.device, d.process, d.files, d.bytes_written, d.tiles)  # noqa: E731
        assert [key(d) for d in one.devices] == [key(d) for d in mine]
        # alone, a process reads the torch.save headers of its chunks itself (in the whole plan
        # another process's device read some of them first): at least the whole plan's bytes
        assert all(a.bytes_read >= b.bytes_read and a.reads >= b.reads for a, b in zip(one.devices, mine, strict=True))
        assert one.processes[0].process == p.process and one.processes[0].bytes_written == p.bytes_written
    assert sum(p.bytes_written for p in whole.processes) == whole.tensor_bytes
    if n > 1:  # more than one process: each reads a part
        assert all(0 < p.bytes_read < sum(q.bytes_read for q in whole.processes) for p in whole.processes)
    assert main(["inspect", src, "--plan", "--mesh", mesh, "--config", config, "--processes", str(n),
                 "--process", "0"]) == 0
    text = capsys.readouterr().out
    assert "process 0:" in text and "process 1:" not in text
    assert main(["inspect", src, "--processes", "2"]) == 2
    assert "only for --plan" in capsys.readouterr().err
    with pytest.raises(Exception, match="positive divisor"):
        plan_import(src, mesh=mesh, config=config, processes=n + 1 if n > 1 else 0)
    with pytest.raises(Exception, match="no device"):
        plan_import(src, mesh=mesh, config=config, process=n, processes=n)


def test_short_reads_are_named(monkeypatch, capsys):
    """A process whose reads average under `SHORT_READ_BYTES` gets a note naming its reads, their
    mean size and the arrays with the most reads (a mesh cutting rows the source stored whole);
    one whose reads are longer gets none. The note's counts are the plan's own."""
    from hybridckpt.jobs import plan_report

    src, config = SOURCES["dcp"]
    mesh = fit("fsdp=2")
    plan = plan_import(src, mesh=mesh, config=config)
    p = plan.processes[0]
    mean = p.bytes_read / p.reads
    monkeypatch.setattr(plan_report, "SHORT_READ_BYTES", int(mean))  # the mean is not under it
    assert plan_import(src, mesh=mesh, config=config).notes == ()
    monkeypatch.setattr(plan_report, "SHORT_READ_BYTES", int(mean) + 1)
    notes = plan_import(src, mesh=mesh, config=config).notes
    assert len(notes) == 1 and notes[0].startswith(f"process 0: {p.reads} reads of {mean:.0f} B on average")
    most = notes[0].split("Most reads: ")[1].split("; ")
    assert len(most) == 3 and all("P(" in x or "PartitionSpec(" in x for x in most), most
    assert main(["inspect", src, "--plan", "--mesh", mesh, "--config", config]) == 0
    assert "note: process 0:" in capsys.readouterr().out


@pytest.mark.skipif(jax.device_count() < 2, reason="2 hosts need 2 devices, one each")
def test_one_host_plan_cuts_the_tiles_that_host_cuts(tmp_path, monkeypatch):
    """`--processes N --process P`: a tile size grown from a dry read of the first tile of the
    first host's joined box (`stream.leaf_tiling`) is that host's box, as on a real N-host
    run where each device's `process_index` is its host, not every device's box joined as in this
    one process. A row-major [512, 128] fp32 file cut on its columns over the devices, 2 hosts:
    the host's own box grows to a smaller tile (2 tiles) than all columns joined would (1 tile)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hybridckpt import lazy
    from hybridckpt.io.byte_source import ByteSource
    from hybridckpt.jobs.plan_report import plan_leaves, process_of

    n = jax.device_count()
    rows, cols = 512, 16 * n
    path = str(tmp_path / "w.bin")
    np.arange(rows * cols, dtype=np.float32).tofile(path)
    t = lazy.StoredTensor(ByteSource(path), 0, (rows, cols), np.dtype(np.float32))
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), PartitionSpec(None, "fsdp"))
    opts = stream.StreamOptions(tile_bytes=4 << 10, chunk_bytes=1 << 10, inflight_bytes=1 << 20)

    def leaf():
        return stream.LazyLeaf(t, sharding, "w", (), opts)

    hosts = 2
    mine = process_of(hosts)
    joined = stream.joined_boxes([b for b, d in box_owners(t.shape, sharding).items() if mine(d) == 0])
    assert joined == [((0, rows), (0, cols // hosts))]
    chunk = stream.chunk_shape(leaf())
    one_process = stream.box_tiles(leaf(), joined[0], chunk, opts.tile_bytes, opts.inflight_bytes)
    monkeypatch.setattr(stream, "_process_index", mine, raising=False)  # what jax says of each device on 2 hosts
    that_host = stream.box_tiles(leaf(), joined[0], chunk, opts.tile_bytes, opts.inflight_bytes)
    monkeypatch.undo()
    assert (len(one_process), len(that_host)) == (1, 2)
    planned = plan_leaves([leaf()], opts.tile_bytes, 0, hosts, opts.inflight_bytes)
    assert [d["tiles"] for d in planned.values()] == [len(that_host)]
    assert sum(d["written"] for d in planned.values()) == rows * cols // hosts * 4
