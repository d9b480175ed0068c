"""The runs of an export's file-to-file copy of our store, cut at chunk boundaries, each carrying
its chunk's CRC-32 check (`store.checked.CheckedArray.file_runs`): the bytes a copier feeds a
`RunCheck` in C order, chunk by chunk."""

from __future__ import annotations

import threading

import numpy as np

from hybridckpt import checksum
from hybridckpt.lazy import Box, FileRun, box_shape


class RunCheck:
    """The CRC-32 of chunk `index` of `array` (a `store.checked.CheckedArray`), fed run by run in
    C order (`feed`); compared (`array.compare`) once all of the chunk's `nbytes` have passed."""

    def __init__(self, array, index: int, nbytes: int):
        self.array, self.index, self.nbytes = array, index, nbytes
        self.crc, self.fed = 0, 0
        self._lock = threading.Lock()

    def feed(self, view) -> None:
        view = memoryview(view).cast("B")
        with self._lock:
            self.crc = checksum.crc32_update(view, self.crc)
            self.fed += len(view)
            if self.fed == self.nbytes:
                self.array.compare(self.index, self.crc)


def assign(array, box: Box, chunks, runs: list[FileRun]) -> list[FileRun] | None:
    """Cut `runs` (the box's C-order bytes) at chunk boundaries and give each piece its chunk's
    RunCheck; None if that would pass `len(runs)` by more than the chunk count allows."""
    item = array.dtype.itemsize
    checks = {pos: array.run_check(pos, int(np.prod(box_shape(c))) * item) for pos, c in chunks}
    # the box's C-order element stream, as segments (elements) each inside one chunk
    segments = segments_of(box, array.chunk, array.shape, array.grid)
    out: list[FileRun] = []
    run_iter = iter(runs)
    run = next(run_iter, None)
    at = 0  # bytes of `run` consumed
    for pos, n_elem in segments:
        want = n_elem * item
        while want:
            if run is None:
                return None
            take = min(want, run.nbytes - at)
            out.append(FileRun(run.source, run.offset + at, take, checks[pos]))
            at += take
            want -= take
            if at == run.nbytes:
                run, at = next(run_iter, None), 0
    return out


def segments_of(box: Box, chunk, shape, grid) -> list[tuple[int, int]]:
    """(chunk position, elements) of the consecutive pieces of `box`'s C-order stream that lie in
    one chunk each: along the first axis whose trailing sub-box lies in one chunk the box is cut
    at chunk boundaries (each piece one segment); before it, one index at a time."""
    out: list[tuple[int, int]] = []

    def pos_of(index) -> int:
        pos = 0
        for i, c, g in zip(index, chunk, grid, strict=True):
            pos = pos * g + i // c
        return pos

    def walk(prefix: tuple[int, ...], d: int) -> None:
        rest = box[d + 1 :]
        inner = int(np.prod([b - a for a, b in rest])) if rest else 1
        if all(a // c == (b - 1) // c for (a, b), c in zip(rest, chunk[d + 1 :], strict=True)):
            a, b = box[d]
            cuts = [a, *range((a // chunk[d] + 1) * chunk[d], b, chunk[d]), b]
            for s, e in zip(cuts, cuts[1:], strict=False):
                pos = pos_of((*prefix, s, *(x for x, _ in rest)))
                if out and out[-1][0] == pos:
                    out[-1] = (pos, out[-1][1] + (e - s) * inner)
                else:
                    out.append((pos, (e - s) * inner))
            return
        for i in range(*box[d]):
            walk((*prefix, i), d + 1)

    if not box:
        return [(0, 1)]
    walk((), 0)
    return out
