"""Benchmark (g)'s measurement (`benchmarks/moe_import.py`) at a tiny size, for HF per-expert
keys, transformers 5's grouped tensors and a torchtitan DCP (torch writes it): an MoE import reads
every expert byte exactly once, and the benchmark's read counter sees a reader that reads the
experts twice (the failure it exists to catch: a box read that ignores its box and reads each
expert whole, once per device half)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import moe_import  # noqa: E402
from meshes import fit

from hybridckpt.lazy import stored  # noqa: E402
from hybridckpt.lazy.box import full_box  # noqa: E402

# 2 layers x 8 experts, embed 64, mlp 128: 1.6 MB of experts over several files
TINY = {
    "layers": 2,
    "experts": 8,
    "hidden": 64,
    "ffn": 128,
    "vocab": 256,
    "heads": 4,
    "kv_heads": 2,
}
SHARD = 200_000


@pytest.fixture(scope="module", params=moe_import.LAYOUTS)
def source(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp(request.param))
    moe_import.write(root, moe_import.config(**TINY), request.param, shard_bytes=SHARD)
    # the HF folders: experts spread over several files; titan: one DCP file (no_dist)
    n = len(moe_import.source_files(root))
    assert n == 1 if request.param == "titan" else n > 3
    return request.param, root


def test_each_expert_byte_read_once(source, tmp_path):
    layout, root = source
    r = moe_import.measure(root, str(tmp_path / "out"), fit("dp=4,fsdp=2", keep="fsdp"))
    assert r["expert_bytes"] == 2 * 8 * 3 * 64 * 128 * 4
    # once, plus (titan) the ends of each chunk that matching its archive reads: 0.6% here
    assert r["ratio"] == pytest.approx(1.0 + moe_import.chunk_ends(layout, root), abs=1e-12) and r["covered"] == 1.0
    if layout != "titan":  # headers included, nothing twice (DCP: torch.save's zip headers skipped)
        assert r["bytes_read"] == r["files_bytes"]
    assert 0 < r["largest_tile_bytes"] <= r["peak_inflight_bytes"]


def whole_per_box(layout: str, mesh: str) -> float:
    """The ratio measured when every stored tensor is read whole for each box, on `mesh`: per-expert
    keys are read once per device part of fsdp=F (which cuts every expert's embed axis), never more
    on dp alone (one box per expert: the bug is invisible there); a grouped tensor [8 experts, ...]
    is read whole for every expert view: transformers' gate_up_proj (8 experts x gate/up x F parts
    = 16F reads) and down_proj (8F) give (2 x 16F + 8F) / 3, torchtitan's w1/w3/w2 (one per
    projection) 8 x F. F counts the boxes a process reads apart: one process holds every fsdp part
    here, and the boxes it writes side by side are read as one (`store.stream.joined_boxes`), so
    F = 1 on every mesh of one process: 1, 40/3, 8 (a per-expert double read cannot happen there,
    the joined box being the whole expert)."""
    f = 1  # (the import's one process joins its fsdp parts: `mesh` no longer multiplies the reads)
    return {"per_expert": f, "fused": 40 * f / 3, "titan": 8 * f}[layout]


def test_a_double_read_is_detected(source, tmp_path, monkeypatch):
    """A reader that reads each stored tensor whole for every box, then cuts the box out (the
    values written are the same): the counter reports each expert read twice or more."""

    def whole_then_cut(self, box, out):
        if out.size:
            whole = np.empty(self.shape, self.dtype)
            plain(self, full_box(self.shape), whole)
            out[...] = whole[tuple(slice(a, b) for a, b in box)]

    plain = stored.StoredTensor.read_into
    monkeypatch.setattr(stored.StoredTensor, "read_into", whole_then_cut)
    layout, root = source
    for mesh in dict.fromkeys((fit("dp=4,fsdp=2", keep="fsdp"), fit("dp=8"))):  # on 1 device, one
        r = moe_import.measure(root, str(tmp_path / mesh), mesh)
        assert r["covered"] == 1.0
        assert r["ratio"] == pytest.approx(whole_per_box(layout, mesh) + moe_import.chunk_ends(layout, root), abs=1e-12)


def test_read_ratio_counts_overlaps_and_holes():
    from array import array

    ranges = {"/f": [(100, 200), (300, 400)]}
    once = {"/f": array("q", [0, 250, 250, 200])}  # one read spans both experts and the gap
    assert moe_import.read_ratio(once, ranges)["ratio"] == 1.0
    twice_with_hole = {"/f": array("q", [100, 50, 100, 50, 300, 100])}
    r = moe_import.read_ratio(twice_with_hole, ranges)
    assert r["ratio"] == 1.0 and r["covered"] == 0.75  # the ratio alone would pass it


def test_the_recorder_sees_every_door_of_byte_source(tmp_path):
    """`moe_import.recording` records the ranges of every `ByteSource` door a reader uses: a
    read, a batch of runs (`read_runs`: the door a large tile's strips go through, which the
    recorder missed until the fifteenth stop: (g) at 1 GiB recorded 0.064x the files the kernel
    read) and a run into strided rows (`read_scatter`), each range once; and not the plan's dry
    reads (`planning`), which read nothing (recorded, they made (g) read 1.058x its experts)."""
    from hybridckpt.io.byte_source import ByteSource, planning

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    src = ByteSource(str(path))
    with moe_import.recording() as reads:
        src.read_into(100, memoryview(bytearray(10)))
        src.read_runs(np.array([1000, 3000, 5000]), 64, memoryview(bytearray(3 * 64)))
        rows = np.zeros((4, 32), np.uint8)
        src.read_scatter(8000, [memoryview(r[:16]) for r in rows])
        with planning():
            src.read_runs(np.array([0, 4096]), 512, memoryview(bytearray(1024)))
            src.read_into(200, memoryview(bytearray(10)))
    got = sorted(map(tuple, np.frombuffer(reads[str(path)], np.int64).reshape(-1, 2).tolist()))
    assert got == [(100, 10), (1000, 64), (3000, 64), (5000, 64), (8000, 64)]
    assert rows[1, :16].tobytes() == (bytes(range(256)) * 64)[8016:8032]
    assert ByteSource.read_runs.__name__ == "read_runs"  # (the doors put back)
