"""A restore reads each item's metadata once, and a restore our reader does never asks Orbax for
it (issue 42: the serial stage before the first chunk is read).

`jobs.restore` asks the store for the params' metadata to plan the target shardings, then
`CheckpointStore.restore` asks again to check the tree against them. Before the store kept what
it read, each was a read of the item's `_METADATA` and array metadata through Orbax (0.03-0.1 s
each on the 2-core VM, on the main thread while no chunk is read yet); then one Orbax read of the
step's metadata (its `metadata(step)` reads every item's tree for any one: 10-20 ms). Now the
store's own reader (`store.bucket_restore.open_item`, as for a store in a bucket) reads each
item's `_METADATA` and arrays once, and the restore that follows reads chunks through the arrays
it opened; Orbax's metadata is read only for a restore Orbax does (`verify_reads=False`, or a
step without CRC tables) or an item our reader refuses. Counted, not timed: the reads of each
kind, the trees equal Orbax's, values the source's.

Its trainer state likewise: `jobs.restore` reads it to plan, `CheckpointStore.restore` read it
again (an Orbax restore of the `trainer_state` item, its CRC tables included); now once a step,
each caller handed a copy of its own (a caller may change the dict it gets).
"""

from __future__ import annotations

from collections import Counter

import test_restore_reads as reads
from meshes import fit, fit_pair

from hybridckpt.store import manager
from hybridckpt.store.manager import CheckpointStore

store = reads.store  # (its fixture, by name here)


def _count_step_metadata_reads(monkeypatch) -> Counter:
    """Orbax's reads of a step's metadata (`CheckpointManager.metadata`: every item's trees, each
    call), counted by step."""
    import orbax.checkpoint as ocp

    seen, real = Counter(), ocp.CheckpointManager.metadata
    monkeypatch.setattr(ocp.CheckpointManager, "metadata",
                        lambda self, step=None: (seen.update([step]), real(self, step))[1])
    return seen


def _count_own_reads(monkeypatch) -> tuple[Counter, Counter]:
    """Our reader's opens of an item (`bucket_restore.open_item`) and listings of its arrays
    (`reader.item_arrays`, which `open_item` and a restore without opened arrays make), by item
    folder name."""
    from hybridckpt.containers.orbax import reader
    from hybridckpt.store import bucket_restore

    opened, listed = Counter(), Counter()
    real_open, real_list = bucket_restore.open_item, reader.item_arrays

    def listing(folder, *a, **k):
        listed.update([str(folder).rstrip("/").rsplit("/", 1)[-1]])
        return real_list(folder, *a, **k)

    monkeypatch.setattr(bucket_restore, "open_item", lambda d: (opened.update([d.rsplit("/", 1)[-1]]), real_open(d))[1])
    monkeypatch.setattr(reader, "item_arrays", listing)
    return opened, listed


def test_a_restore_reads_the_params_metadata_once(store, monkeypatch):
    src, ck = store
    seen = _count_step_metadata_reads(monkeypatch)
    opened, listed = _count_own_reads(monkeypatch)
    cfg, r, _ = reads.restore_counted(ck, fit_pair(fit(reads.SAVED), reads.TARGETS[0])[1])
    assert sum(seen.values()) == 0, seen  # (before our reader: 1; before the store kept it: 2)
    assert opened == Counter(params=1) and listed == Counter(params=1), (opened, listed)
    reads.same_as_source(src, cfg, r.params)


def test_a_restore_orbax_does_reads_the_steps_metadata_once(store, monkeypatch):
    """Without the CRC checks (`verify_reads=False`) Orbax restores the arrays, so the tree checked
    against the targets is Orbax's own: one read of the step's metadata for the plan and the
    restore together."""
    src, ck = store
    seen = _count_step_metadata_reads(monkeypatch)
    cfg, r, _ = reads.restore_counted(ck, fit_pair(fit(reads.SAVED), reads.TARGETS[0])[1], verify_reads=False)
    assert sum(seen.values()) == 1, seen
    reads.same_as_source(src, cfg, r.params)


def test_an_item_our_reader_refuses_is_read_by_orbax(store, monkeypatch):
    """A local item whose `_METADATA` our reader refuses (a leaf only Orbax reads: here every
    item, by a stand-in) is left to Orbax, which reads it; in a bucket the refusal stands (Orbax
    would read a local view's placeholders: tests/store/test_bucket_restore.py)."""
    from hybridckpt.errors import CheckpointError
    from hybridckpt.store import bucket_restore

    src, ck = store

    def refuse(d):
        raise CheckpointError(f"{d}/_METADATA: leaf 'x' is a 'scalar', not an array")

    monkeypatch.setattr(bucket_restore, "open_item", refuse)
    seen = _count_step_metadata_reads(monkeypatch)
    cfg, r, _ = reads.restore_counted(ck, fit_pair(fit(reads.SAVED), reads.TARGETS[0])[1])
    assert sum(seen.values()) == 1, seen
    reads.same_as_source(src, cfg, r.params)


def test_a_restore_with_optimizer_state_reads_the_steps_metadata_once(tmp_path, monkeypatch):
    """Orbax's `metadata(step)` reads every item's tree whichever one is wanted: the params' and
    then the optimizer state's were two reads of the same (20-30 ms each on the 2-core VM, the
    serial start of a restore), then one; now none: each item read once by our reader, the trees
    the same as Orbax's for each item."""
    import jax

    import hybridckpt
    from hybridckpt.demo import sample_path
    from hybridckpt.jobs.import_ import import_checkpoint
    from hybridckpt.store.orbax_io import as_shape_dtype, item_metadata, read_only_manager

    ck = str(tmp_path / "ck")
    import_checkpoint(sample_path(), ck, mesh=fit("fsdp=2"))
    seen = _count_step_metadata_reads(monkeypatch)
    opened, listed = _count_own_reads(monkeypatch)
    _, r = hybridckpt.restore(ck, fit("fsdp=2"))
    assert r.opt_state is not None
    assert sum(seen.values()) == 0, seen  # (before: 1; before that, 2: one for the params, one for the AdamW state)
    assert opened == Counter(params=1, opt_state=1) == listed, (opened, listed)
    monkeypatch.undo()
    with CheckpointStore(ck) as s:
        step = s.trainer_state()["step"]
        mine = {"params": s.params_metadata(step), "opt_state": s.opt_state_metadata(step)}
    m = read_only_manager(ck)
    for item, tree in mine.items():
        want = as_shape_dtype(item_metadata(m, step, item))
        assert jax.tree.structure(tree) == jax.tree.structure(want), item
        assert jax.tree.leaves(tree) == jax.tree.leaves(want), item


def test_a_restore_reads_the_trainer_state_once_and_each_caller_gets_its_own(store, monkeypatch):
    src, ck = store
    reads_of, real = [], manager.read_json
    monkeypatch.setattr(manager, "read_json", lambda m, step: (reads_of.append(step), real(m, step))[1])
    cfg, r, _ = reads.restore_counted(ck, fit_pair(fit(reads.SAVED), reads.TARGETS[0])[1])
    assert len(reads_of) == 1, reads_of  # (before: 2)
    reads.same_as_source(src, cfg, r.params)
    with CheckpointStore(ck) as s:
        first = s.trainer_state()
        step = first["step"]
        first["step"] = -1
        first["mesh"]["changed"] = 1  # (a nested object too)
        again = s.trainer_state(step)
        assert again["step"] == step and "changed" not in again["mesh"]
        assert again == r.trainer_state and again is not r.trainer_state
    assert len(reads_of) == 2  # (the new store's one)
