"""A restore reads each item's Orbax metadata once (issue 42: the serial stage before the first
chunk is read).

`jobs.restore` asks the store for the params' metadata to plan the target shardings, then
`CheckpointStore.restore` asks again to check the tree against them: before, each was a read of
the item's `_METADATA` and array metadata through Orbax (0.03-0.1 s each on the 2-core VM, on
the main thread while no chunk is read yet). The store now keeps the tree it read per (step,
item) for its life (a save forgets them). Counted, not timed: one Orbax metadata read an item,
values the source's.
"""

from __future__ import annotations

from collections import Counter

import test_restore_reads as reads
from meshes import fit, fit_pair

from hybridckpt.store import manager

store = reads.store  # (its fixture, by name here)


def test_a_restore_reads_the_params_metadata_once(store, monkeypatch):
    src, ck = store
    seen, real = Counter(), manager.item_metadata
    monkeypatch.setattr(manager, "item_metadata", lambda m, step, item: (seen.update([item]), real(m, step, item))[1])
    cfg, r, _ = reads.restore_counted(ck, fit_pair(fit(reads.SAVED), reads.TARGETS[0])[1])
    assert seen == Counter({"params": 1}), seen  # (before: 2)
    reads.same_as_source(src, cfg, r.params)
