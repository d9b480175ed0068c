"""`store.chunk_fill`: the arrays of a restore filled chunk by chunk, and what goes box by box instead.

Counted, not timed, on the store of tests/store/test_restore_reads.py (an HF Llama imported onto
fsdp=2,tp=2): which arrays the chunk fill takes, that one it cannot take is still read exactly
(box by box), that a damaged chunk stops the fill with the error naming it and leaves no worker
behind, and that the fill reads the chunks of one array only once for any number of boxes."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest
import test_restore_reads as reads
from meshes import fit, fit_pair

import hybridckpt
from hybridckpt.errors import CheckpointError
from hybridckpt.store import chunk_fill, read_trainer_state

store, counted_copies = reads.store, reads.counted_copies  # (its fixtures, by name here)
SAVED, TARGETS = reads.SAVED, reads.TARGETS
pytestmark = pytest.mark.multidevice  # (the store fixture imports onto `fit(SAVED)`: the scan cannot see it)


def _up_kernel(ck):
    return reads._up_kernel(ck)


def test_which_arrays_are_filled_by_chunks(store):
    """A checked raw chunk grid read in its stored dtype is; a cast, an unchecked array, or one
    asked inside a read plan is not (those go box by box)."""
    from hybridckpt.io.byte_source import planning

    _, ck = store
    t = _up_kernel(ck)
    assert chunk_fill.ArrayFill.eligible(t, t.dtype)
    assert not chunk_fill.ArrayFill.eligible(t, np.float16)  # (a cast)
    assert not chunk_fill.ArrayFill.eligible(t.inner, t.dtype)  # (unchecked: `verify_reads=False`)
    with planning():
        assert not chunk_fill.ArrayFill.eligible(t, t.dtype)


def test_unchecked_reads_go_box_by_box(store, counted_copies):
    src, ck = store
    cfg, r, read = reads.restore_counted(ck, fit_pair(fit(SAVED), TARGETS[0])[1], verify_reads=False)
    assert sum(counted_copies["jobs"].values()) == 0
    reads.same_as_source(src, cfg, r.params)


def test_an_array_whose_cut_chunks_need_too_large_a_buffer_goes_box_by_box(store, counted_copies, monkeypatch):
    """`LENT_MAX` bounds the buffer a worker borrows for a chunk it must cut: past it, the array is
    read box by box (its pieces straight into their shards), values and checks the same."""
    src, ck = store
    monkeypatch.setattr(chunk_fill, "LENT_MAX", 1)
    mesh = fit_pair(fit(SAVED), TARGETS[0])[1]
    cfg, r, read = reads.restore_counted(ck, mesh)
    counts = counted_copies
    grids = read_trainer_state(ck)["checksum_chunks"]
    from hybridckpt import naming

    box_by_box = 0
    for name, a in naming.flatten(r.params).items():
        _, parts, into_place = reads.chunk_parts(a, grids[f"params.{name}"])
        if parts > into_place:  # (a chunk to cut: not planned by chunks)
            assert counts["jobs"][name] == 0, (name, counts)
            box_by_box += 1
    assert box_by_box > 0 or fit(SAVED) == mesh
    needed, _ = reads.needed_bytes(ck, r.params)
    assert needed <= read <= 1.05 * needed and r.profile.stage("checksum").bytes == needed
    reads.same_as_source(src, cfg, r.params)


def test_a_damaged_chunk_stops_the_fill_names_the_chunk_and_leaves_no_worker(store, tmp_path):
    """A byte flipped in a chunk of the last array filled: the restore raises the CheckpointError
    of that chunk (array, grid position, file), the other workers take no further job, and none is
    left running: the next restore of the intact store, in the same process, is exact."""
    src, ck = store
    bad = str(tmp_path / "ck")
    shutil.copytree(ck, bad)
    step = next(d for d in os.listdir(bad) if d.isdigit())
    item = os.path.join(bad, step, "params")
    arrays = sorted(d for d in os.listdir(item) if d.startswith("layers.") and d.endswith(".kernel"))
    path = os.path.join(item, arrays[-1], "0.0.0")
    with open(path, "r+b") as f:
        f.seek(4)
        b = f.read(1)
        f.seek(4)
        f.write(bytes([b[0] ^ 0x08]))
    mesh = fit_pair(fit(SAVED), TARGETS[0])[1]
    before = threading.active_count()
    with pytest.raises(CheckpointError, match=r"chunk 0\.0\.0 .*CRC-32") as e:
        hybridckpt.restore(bad, mesh)
    assert path in str(e.value)
    cfg, r, read = reads.restore_counted(ck, mesh)
    reads.same_as_source(src, cfg, r.params)
    assert threading.active_count() <= max(before, 1) + 16  # (the reader pool's threads at most: idle)


def test_a_fill_that_stops_early_takes_no_further_chunk(store, monkeypatch):
    """The first error of any worker stops the queue: the jobs not yet taken are dropped, not read
    (counted: after a job fails, at most the jobs the other workers had already taken run)."""
    _, ck = store
    ran, lock, failed = [], threading.Lock(), []
    real = chunk_fill.ChunkJob.run

    def run(self, lent):
        with lock:
            ran.append(self.fill.array.name)
            first = len(ran) == 1
        if first:
            failed.append(True)
            raise CheckpointError("the first chunk fails")
        return real(self, lent)

    monkeypatch.setattr(chunk_fill.ChunkJob, "run", run)
    with pytest.raises(CheckpointError, match="the first chunk fails"):
        hybridckpt.restore(ck, fit_pair(fit(SAVED), TARGETS[0])[1])
    from hybridckpt.lazy import parallel

    assert failed and len(ran) <= parallel.io_threads() + 1, len(ran)


def test_chunks_neighbouring_in_the_grids_last_dim_are_taken_apart():
    """`grid_apart`: an array's chunk jobs go last grid dim slowest, so the chunks the reader threads
    take at once lie in different rows of the grid (whose parts land on different pages of the
    shards), not side by side in the same rows (whose parts share those pages)."""
    order = lambda grid: sorted(range(int(np.prod(grid))), key=lambda p: chunk_fill.grid_apart(p, grid))  # noqa: E731
    assert order((2, 4)) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert order((3, 2, 2)) == [0, 4, 8, 2, 6, 10, 1, 5, 9, 3, 7, 11]
    assert order((5,)) == [0, 1, 2, 3, 4] and order((1, 3)) == [0, 1, 2]


def test_a_planned_array_takes_its_chunks_apart(store):
    """The jobs `ArrayFill.plan` makes for an array cut across its grid's last dim come in
    `grid_apart` order (C order would put a row's chunks side by side), and still one job a chunk."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hybridckpt.mesh import as_mesh

    _, ck = store
    t = _up_kernel(ck)
    assert len(t.grid) == 3 and t.grid[1] > 1 and t.grid[2] > 1, t.grid  # ([layers, embed, ffn]: cut both ways)
    n = min(4, len(jax.devices()))
    fill = chunk_fill.ArrayFill(t, NamedSharding(as_mesh(f"fsdp={n}"), P(None, "fsdp", None)))
    assert fill.plan()
    got = [job.pos for job in fill.jobs]
    assert sorted(got) == list(range(int(np.prod(t.grid))))  # (every chunk once)
    assert got == sorted(got, key=lambda p: chunk_fill.grid_apart(p, t.grid)) and got != sorted(got)
    grid_rows = [np.unravel_index(p, t.grid)[:-1] for p in got]
    assert all(a != b for a, b in zip(grid_rows, grid_rows[1:], strict=False) if t.grid[0] * t.grid[1] > 1)
