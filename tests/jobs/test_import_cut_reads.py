"""An import whose mesh cuts the rows its source stored whole reads them once or in batches (issue 42).

A torch DCP checkpoint (written in-process by torch itself) holds a `[1024, 2048]` fp32 weight in
one chunk, rows of 8 KiB stored whole (as an FSDP2 rank stores its rows). Imported with no model
config, the generic rule puts fsdp on the columns: each device's box is a 2 KiB strip of every
row, 1024 runs 6 KiB apart (on 4 devices). One process holding all the strips reads each row
once (`store.stream.joined_boxes`) and cuts it in memory; a host holding one strip (the plan of
process 0 of 4) has its runs at most `GAP_PER_CALL_BYTES` apart joined into one `preadv` each
`IOV_MAX // 2` (`ByteSource.read_runs`), the gaps read into a scratch buffer and counted as gap
bytes: rows / 512 reads, not one a row. The counts are calls and bytes (`count_reads`), not time;
the values restored are the source's, bit for bit; the plan counts the same reads as the import.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from meshes import fit

from hybridckpt.io.byte_source import close_all, count_reads
from hybridckpt.io.read_batches import IOV_MAX
from hybridckpt.io.read_tally import runs_of
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.jobs.plan_report import plan_import
from hybridckpt.mesh import MeshShape

ROWS, COLS = 1024, 2048  # fp32: rows of 8 KiB (the generic rule cuts the longer dim: columns)


def _source(tmp_path) -> tuple[str, np.ndarray]:
    import torch
    import torch.distributed.checkpoint as tdcp

    g = torch.Generator().manual_seed(42)
    w = torch.randn(ROWS, COLS, generator=g)
    src = tmp_path / "dcp"
    tdcp.save({"model": {"w": w}}, checkpoint_id=str(src), no_dist=True)
    return str(src), w.numpy().copy()


def test_a_cut_import_reads_rows_once_or_in_batches(tmp_path):
    src, want = _source(tmp_path)
    mesh = fit("fsdp=4")
    k = MeshShape.parse(mesh).as_dict().get("fsdp", 1)
    close_all()
    with count_reads() as c:
        import_checkpoint(src, str(tmp_path / "ck"), mesh=mesh)
    data = [p for p in c if isinstance(p, str) and p.endswith(".distcp")]
    assert len(data) == 1
    f = data[0]  # (the `.metadata` read is the opening's, no device's)
    nbytes, calls, gaps = c[f], c[(f, "calls")], c[(f, "gap")]
    runs = runs_of(Counter({key: v for key, v in c.items() if isinstance(key, tuple) and key[0] == f}))
    # one process holds every strip: they are joined (`store.stream.joined_boxes`), whole rows
    # read once, no gap; before: a pread a strip of every row, k * ROWS of them
    assert gaps == 0 and calls == runs and calls <= 16, (calls, runs)
    assert want.nbytes <= nbytes <= want.nbytes + 4096  # every byte of the weight read once (and the header)

    import hybridckpt

    _, restored = hybridckpt.restore(str(tmp_path / "ck"), mesh)
    got = np.asarray(restored.params["w"])
    assert got.tobytes() == want.tobytes()  # bitwise

    plan = plan_import(src, mesh=mesh)
    p = plan.processes[0]
    assert (p.reads, p.runs, p.gap_bytes) == (calls, runs, gaps)

    # a host of one device holds one strip of every row: its runs are batched into preadvs (the plan
    # reads as the import does, tests/jobs/test_plan_report.py), IOV_MAX // 2 runs a call
    import jax

    one = plan_import(src, mesh=mesh, processes=jax.device_count(), process=0).processes[0]  # device 0's
    header = one.runs - (ROWS if k > 1 else 1)
    strip = COLS // k * 4
    batches = -(-ROWS // (IOV_MAX // 2)) if k > 1 else 1
    assert 0 <= header <= 16 and one.reads == header + batches, (one.reads, one.runs)  # before: header + ROWS
    assert one.gap_bytes == (ROWS - batches) * (COLS * 4 - strip)  # the gaps inside each batch, read once


def test_joined_boxes_cover_the_same_cells_and_join_only_touching_boxes():
    """`store.stream.joined_boxes`: a 4 x 4 grid of boxes is one box; boxes with a hole between
    them, or alike on no axis but one that they do not touch on, stay apart; the joined boxes
    cover exactly the cells of the boxes given, each once."""
    from hybridckpt.store.stream import joined_boxes

    grid = [((i, i + 1), (j, j + 2)) for i in range(4) for j in range(0, 8, 2)]
    assert joined_boxes(grid) == [((0, 4), (0, 8))]
    apart = [((0, 1), (0, 2)), ((0, 1), (4, 6)), ((1, 2), (2, 4))]
    assert joined_boxes(apart) == sorted(apart)

    def cells(boxes):
        return sorted((x, y) for (a, b), (c, d) in boxes for x in range(a, b) for y in range(c, d))

    for keep in range(1, 1 << len(grid), 37):  # subsets of the grid, holes included
        some = [g for i, g in enumerate(grid) if keep >> i & 1]
        assert cells(joined_boxes(some)) == cells(some), some
