"""A reshaped 1-D range read from its source's file runs: per file, not per row.

A Megatron distributed optimizer's master weights and moments (and a ZeRO flat's parameters)
are `Reshape`s of slices of flat 1-D buckets. A box of such a view is `N` rows of `run_len`
elements at C-order flat `starts` of the source. When the source's bytes from the box's first
element to its last are a few runs of files (a bucket cut between DP ranks' files: one run per
file), each run's whole rows are read by one `ByteSource.read_runs` call (batched preadvs, the
rows straight into their place in the caller's buffer), and the at most one row per run edge
that crosses it is read in pieces. Python work per box is O(runs of the span), not O(N): the
per-row path (`read_flat` through the views, ~100 us a row) cost a 405B torch_dist one-host
plan tens of millions of calls.
"""

from __future__ import annotations

import numpy as np

from hybridckpt.lazy.base import FileRun, LazyTensor

MAX_SPAN_RUNS = 1024  # most file runs a box's span may be made of (else the row path)


def span_runs(src: LazyTensor, lo: int, hi: int) -> list[FileRun] | None:
    """The file runs of the 1-D `src`'s elements `[lo, hi)`, in order, when they are plain file
    bytes (no store check to feed), whole elements each, and cover the span exactly; else None."""
    runs = src.file_runs(((lo, hi),), MAX_SPAN_RUNS)
    item = np.dtype(src.dtype).itemsize
    if not runs or any(r.check is not None or r.nbytes % item for r in runs):
        return None
    if sum(r.nbytes for r in runs) != (hi - lo) * item:
        return None
    return runs


def read_rows(runs: list[FileRun], lo: int, starts: np.ndarray, run_len: int, item: int,
              out: np.ndarray) -> None:
    """Fill the packed bytes `out` (uint8, `len(starts) * run_len * item`) with the rows of
    `run_len` elements at the increasing flat `starts`, which lie in `runs` (element `lo` at
    the first run's first byte): one `read_runs` per run for the rows inside it, one
    `read_into` per piece of a row that crosses a run's edge."""
    row_bytes = run_len * item
    ends = starts + run_len
    edges = lo + np.cumsum([0] + [r.nbytes // item for r in runs])  # element edges of the runs
    for k, r in enumerate(runs):
        e0, e1 = int(edges[k]), int(edges[k + 1])
        i0 = int(np.searchsorted(starts, e0, side="left"))  # first row starting in the run
        i1 = int(np.searchsorted(ends, e1, side="right"))  # rows ending by the run's end
        if i1 > i0:
            offsets = r.offset + (starts[i0:i1].astype(np.int64) - e0) * item
            r.source.read_runs(offsets, row_bytes, memoryview(out[i0 * row_bytes : i1 * row_bytes]))
    crossing = set()  # rows with an edge strictly inside: at most one per edge
    for x in edges[1:-1].tolist():
        i = int(np.searchsorted(starts, x, side="left")) - 1
        if i >= 0 and int(ends[i]) > x:
            crossing.add(i)
    for i in sorted(crossing):
        _row_pieces(runs, edges, int(starts[i]), run_len, item, out[i * row_bytes : (i + 1) * row_bytes])


def _row_pieces(runs: list[FileRun], edges: np.ndarray, start: int, run_len: int, item: int,
                row: np.ndarray) -> None:
    """The row of `run_len` elements at flat `start` into `row`, a `read_into` per run it touches."""
    k = int(np.searchsorted(edges, start, side="right")) - 1
    pos, end = start, start + run_len
    while pos < end:
        stop = min(end, int(edges[k + 1]))
        r = runs[k]
        r.source.read_into(r.offset + (pos - int(edges[k])) * item,
                           memoryview(row[(pos - start) * item : (stop - start) * item]))
        pos, k = stop, k + 1
