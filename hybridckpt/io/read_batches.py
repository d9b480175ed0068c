"""How many short runs of a file one read call takes: the batching rule of `ByteSource.read_runs`.

Pure planning: the import's plan (`jobs.plan_report`) counts the same batches as the reads make.
"""

from __future__ import annotations

import numpy as np

GAP_PER_CALL_BYTES = 8 << 10  # bytes: a gap this short between two runs is read (into scratch)
# rather than skipped by a second call. Measured on the 2-core VM: one pread from Python costs
# ~3.9 us, the kernel's copy out of the page cache ~0.3-0.6 ns/B, so a call costs as much as
# copying 6-13 KiB; a preadv of 512 runs of 1 KiB with 7 KiB gaps took 1.5 us a run against 3.9.
IOV_MAX = 1024  # Linux's most buffers in one preadv (`sysconf(SC_IOV_MAX)`): runs and gaps together


def run_batches(offsets: np.ndarray, run_bytes: int) -> tuple[np.ndarray, int]:
    """How `ByteSource.read_runs` reads runs of `run_bytes` at file byte `offsets` (in order):
    (the index of each batch's first run, the gap bytes read). A batch is consecutive runs each
    starting at most `GAP_PER_CALL_BYTES` after the previous one ends (never before it: runs out
    of order or overlapping start a new batch), at most `IOV_MAX // 2` runs (its runs and gaps
    are one preadv's buffers); each batch is one call. Pure: the plan counts the same batches."""
    offs = np.asarray(offsets, dtype=np.int64)
    if len(offs) == 0:
        return np.zeros(0, np.int64), 0
    gap = offs[1:] - offs[:-1] - run_bytes
    joined = (gap >= 0) & (gap <= GAP_PER_CALL_BYTES)
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    per = IOV_MAX // 2
    if len(offs) > per:  # a batch longer than `per` runs is cut every `per` runs
        starts = _cut(starts, len(offs), per)
    inside = joined.copy()
    inside[starts[1:] - 1] = False  # the gap before a batch's first run is not read
    return starts, int(gap[inside].sum())


def _cut(starts: np.ndarray, n: int, per: int) -> np.ndarray:
    """The first runs of batches starting at `starts` (of `n` runs in all) once each is cut every
    `per` runs; array arithmetic, no Python a batch (a box of millions of rows far apart is
    millions of batches)."""
    lens = np.append(starts[1:], n) - starts
    pieces = (lens + per - 1) // per
    first = np.cumsum(pieces) - pieces  # each batch's first piece's index
    return np.repeat(starts, pieces) + (np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(first, pieces)) * per
