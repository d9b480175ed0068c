"""An import whose mesh cuts the rows its source stored whole reads them in batches (issue 42).

A torch DCP checkpoint (written in-process by torch itself) holds a `[1024, 2048]` fp32 weight in
one chunk, rows of 8 KiB stored whole (as an FSDP2 rank stores its rows). Imported with no model
config, the generic rule puts fsdp on the columns: each device's box is a 2 KiB strip of every
row, 1024 runs 6 KiB apart (on 4 devices). `ByteSource.read_runs` joins runs at most `GAP_PER_CALL_BYTES` apart
into one `preadv` (at most `IOV_MAX // 2` runs each), so the import makes rows / 512 reads a box,
not one a row; the gaps are read into a scratch buffer and counted as gap bytes. The counts are
calls and bytes (`count_reads`), not time; the values restored are the source's, bit for bit;
the plan (`import --plan`) counts the same reads, runs and gap bytes.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from meshes import fit

from hybridckpt.io.byte_source import IOV_MAX, close_all, count_reads, runs_of
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


def test_a_cut_import_reads_rows_in_batches(tmp_path):
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
    runs = runs_of(Counter({k: v for k, v in c.items() if isinstance(k, tuple) and k[0] == f}))
    strip = COLS // k * 4
    per_box = ROWS if k > 1 else 1  # runs of a box: a strip of every row (one run: whole rows)
    batches = -(-per_box // (IOV_MAX // 2))
    header_calls = calls - k * batches  # the chunk's torch.save header, read on first use
    assert runs - header_calls == k * per_box  # every row's strip is a run
    assert 0 <= header_calls <= 16 and calls <= k * (ROWS // 512) + 16, (calls, runs)  # before: k * ROWS + headers
    assert gaps == k * (per_box - batches) * (COLS * 4 - strip)  # the gaps inside each batch, read once
    assert nbytes >= want.nbytes  # every byte of the weight read once (plus the header)

    import hybridckpt

    _, restored = hybridckpt.restore(str(tmp_path / "ck"), mesh)
    got = np.asarray(restored.params["w"])
    assert got.tobytes() == want.tobytes()  # bitwise

    plan = plan_import(src, mesh=mesh)
    p = plan.processes[0]
    assert (p.reads, p.runs, p.gap_bytes) == (calls, runs, gaps)
