"""A chunk a restore's box holds whole but not as one run of its shard (the box is wider than the
chunk: its rows are strips of the shard's rows) is read into a buffer the restore's scratch pool
lends, checked there and copied into its shard (issue 42's cold restore); a chunk that is one run
of its shard is read straight into it (`store.chunk_fill`).

Before, each such chunk was read into a fresh buffer (`OrbaxArray.read_box`): a fresh allocation
a chunk, its pages faulted in by the read and freed after the copy (a restore onto fewer devices
than the import's: onto one device, the 1.1 GB store of docs/benchmarks.md made 520 of them, 20k
more page faults). Counted, not timed: no fresh chunk buffer, one read and one CRC-32 call a
chunk, one copy a strided chunk, at most one buffer the pool made a worker, every byte read once
and checked, values the source's.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import test_restore_reads as reads
from meshes import fit, fit_pair

from hybridckpt import naming
from hybridckpt.lazy import parallel
from hybridckpt.store import checked, read_trainer_state

store, counted_copies = reads.store, reads.counted_copies  # (its fixtures, by name here)
SAVED, needed_bytes, restore_counted, same_as_source = reads.SAVED, reads.needed_bytes, reads.restore_counted, reads.same_as_source
WIDER = "fsdp=2"  # boxes of whole rows: each holds the two tp halves of its chunks' rows whole


def test_a_whole_chunk_strided_in_its_shard_is_read_into_a_lent_buffer(store, counted_copies, monkeypatch):
    src, ck = store
    monkeypatch.setattr(parallel, "_override", 2)  # (put back after the test)
    counts = counted_copies
    cfg, r, read = restore_counted(ck, fit_pair(fit(SAVED), WIDER)[1])
    grids = read_trainer_state(ck)["checksum_chunks"]
    strided = chunks = 0
    for name, a in naming.flatten(r.params).items():
        n = _strided_chunks(a, grids[f"params.{name}"])
        met = int(np.prod([-(-m // c) for m, c in zip(a.shape, grids[f"params.{name}"], strict=True)]))
        strided += n
        assert counts["buffers"][name] == 0, (name, counts)  # (before: n, a fresh buffer a chunk)
        if counts["jobs"][name]:  # (filled by chunks: every array but those of one chunk)
            chunks += met
            _, parts, into_place = reads.chunk_parts(a, grids[f"params.{name}"])
            assert counts["jobs"][name] == counts["chunk_crcs"][name] == met, (name, counts)
            assert counts["into_place"][name] == into_place <= met - n, (name, counts)
            assert counts["parts"][name] == parts - into_place >= n, (name, counts)
    if jax.device_count() >= 4:  # (fsdp=2,tp=2 onto fsdp=2: every box holds its chunks whole)
        assert strided > 0 and chunks > 0
        assert 0 < sum(counts["lent"].values()) <= 2 < strided, counts
    assert checked._HeldChunks.budget_used[0] == 0  # noqa: SLF001
    needed, _ = needed_bytes(ck, r.params)
    assert needed == read and r.profile.stage("checksum").bytes == needed
    same_as_source(src, cfg, r.params)


def _strided_chunks(a, chunk) -> int:
    """How many of the array's chunks a device's box holds whole but not as one run of its bytes
    (past the chunk's first axis longer than 1, the box is wider than the chunk on some axis)."""
    found = set()
    for index in a.sharding.devices_indices_map(a.shape).values():
        box = [(s.start or 0, a.shape[d] if s.stop is None else s.stop) for d, s in enumerate(index)]
        ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, chunk, strict=True)]
        for idx in itertools.product(*ranges):
            cbox = [(i * c, min(n, (i + 1) * c)) for i, c, n in zip(idx, chunk, a.shape, strict=True)]
            if any(ca < lo or cb > hi for (ca, cb), (lo, hi) in zip(cbox, box, strict=True)):
                continue  # (a piece of it: cut, not read whole here)
            ext = [b - a for a, b in cbox]
            first = next((d for d, e in enumerate(ext) if e > 1), len(ext))
            if any(ext[d] != box[d][1] - box[d][0] for d in range(first + 1, len(ext))):
                found.add(idx)
    return len(found)
