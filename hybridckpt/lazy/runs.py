"""File runs: where a box's bytes already lie in files, so an export copies instead of reads.

`file_runs(box, limit)` of a view that only rearranges stored bytes (concatenations, stacks,
slices, reshapes; not casts, transposes or in-memory arrays) is the box's C-order bytes as at
most `limit` `FileRun`s; an export then copies those runs file to file
(`io.sequential_file.SequentialFile.copy_run`) instead of materialising the tensor, and
`copy_runs` picks the tensors worth it. Touching runs (same source,
one ending where the next starts) are merged into one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridckpt.lazy.base import FileRun, LazyTensor
from hybridckpt.lazy.box import Box, block_overlap, box_shape, full_box


def join_runs(groups: Iterable[list[FileRun] | None], limit: int) -> list[FileRun] | None:
    """The runs of `groups` in order, touching ones merged; None when a group is None or the
    total passes `limit` (stops consuming `groups` there)."""
    out: list[FileRun] = []
    for runs in groups:
        if runs is None:
            return None
        for r in runs:
            last = out[-1] if out else None
            if (last is not None and last.source == r.source and last.offset + last.nbytes == r.offset
                    and last.check is r.check):
                out[-1] = FileRun(r.source, last.offset, last.nbytes + r.nbytes, r.check)
            else:
                out.append(r)
                if len(out) > limit:
                    return None
    return out


def tiled_file_runs(
    box: Box, pieces: Iterable[tuple[Sequence[int], LazyTensor]], limit: int
) -> list[FileRun] | None:
    """`file_runs` of `box` over blocks `pieces` (`(offsets, block)`) that tile the tensor.

    Along the first dimension where the box is longer than 1 (the box is a single index before
    it), blocks that each span the rest of the box are its C order one after another; otherwise
    the box is split into unit slices on that dimension and each is walked the same way.
    """
    hits = []
    for offs, block in pieces:
        sub = block_overlap(box, offs, block.shape)
        if sub is not None:
            hits.append((tuple(offs), block, sub))
    if len(hits) <= 1:
        return [] if not hits else hits[0][1].file_runs(hits[0][2], limit)
    d = next((i for i, (a, b) in enumerate(box) if b - a > 1), None)
    if d is None:  # blocks that overlap: not a tiling
        return None
    if all(box_shape(sub)[d + 1 :] == box_shape(box)[d + 1 :] for _, _, sub in hits):
        hits.sort(key=lambda h: h[0][d])
        return join_runs((block.file_runs(sub, limit) for _, block, sub in hits), limit)
    a, b = box[d]
    if (b - a) * 2 > limit:
        return None
    rows = (box[:d] + ((i, i + 1),) + box[d + 1 :] for i in range(a, b))
    return join_runs((tiled_file_runs(r, pieces, limit) for r in rows), limit)


MIN_COPY_RUN_BYTES = 64 << 10  # bytes: a tensor whose runs average less is read and written instead


def copy_runs(t: LazyTensor) -> list[FileRun] | None:
    """The file runs of all of `t` when it is worth copying file to file: at most a few runs
    (4) or runs of `MIN_COPY_RUN_BYTES` on average; else None."""
    if t.nbytes == 0:
        return None
    return t.file_runs(full_box(t.shape), max(4, t.nbytes // MIN_COPY_RUN_BYTES))
