"""One ZeRO-3 parameter (or its slot) over every rank's flat partition, as one lazy 1-D tensor.

ZeRO-3 splits every parameter on its own: with `pn = ceil(numel / dp)`, rank r holds its flat
elements `[r*pn, (r+1)*pn)` (the last rank's tail is padding) at `[offset, offset + pn)` of its
flat (its sub-groups joined end to end). Built as views, that is a slice per rank per parameter
per kind: 1137 params x 3 (master, `exp_avg`, `exp_avg_sq`) x 512 ranks = 1.75M Python objects
for Llama 405B on 512 ranks (0.9 GiB, measured: docs/scale.md). `Zero3Flat` keeps the ranks'
flats (one tuple, shared by every parameter) and the offset: two numbers a parameter, whatever
the rank count; a read asks only the ranks its range covers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from hybridckpt.lazy import LazyTensor
from hybridckpt.lazy.base import FileRun
from hybridckpt.lazy.box import Box
from hybridckpt.lazy.runs import join_runs
from hybridckpt.lazy.views import Concat


@dataclass(frozen=True, eq=False)
class Zero3Flat(LazyTensor):
    """`numel` elements, `[r*part, (r+1)*part)` at `[offset, offset + part)` of `flats[r]` (1-D,
    one per rank, all of one dtype and at least `offset + part` long: the caller checks)."""

    flats: tuple[LazyTensor, ...]
    offset: int
    part: int
    numel: int
    bounds: tuple[int, ...] | None = None  # every flat's sub-group edges, when all ranks share them

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.numel,)

    @property
    def dtype(self) -> np.dtype:
        return self.flats[0].dtype

    def _spans(self, a: int, b: int):
        """(rank, its box, the span `[s, e)` of ours it holds) for elements `[a, b)`."""
        if b <= a or self.part == 0:
            return
        for r in range(a // self.part, (b - 1) // self.part + 1):
            lo = r * self.part
            s, e = max(a, lo), min(b, lo + self.part)
            yield r, ((self.offset + s - lo, self.offset + e - lo),), s, e

    def read_into(self, box: Box, out: np.ndarray) -> None:
        (a, b), = box
        for r, sub, s, e in self._spans(a, b):
            self.flats[r].read_into(sub, out[s - a : e - a])

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        (a, b), = box
        return join_runs((self.flats[r].file_runs(sub, limit) for r, sub, _, _ in self._spans(a, b)), limit)

    def stored_pieces(self) -> int:
        """How many stored arrays the ranks' ranges lie in (a range can cross a sub-group end)."""
        if self.bounds is None:
            return sum(_touched(_edges(self.flats[r]), sub[0]) for r, sub, _, _ in self._spans(0, self.numel))
        n = -(-self.numel // self.part) if self.part else 0  # the ranks holding elements
        if n == 0:
            return 0
        last = self.numel - (n - 1) * self.part
        full = _touched(self.bounds, (self.offset, self.offset + self.part))
        return (n - 1) * full + _touched(self.bounds, (self.offset, self.offset + last))


def edges(flats) -> tuple[int, ...] | None:
    """The sub-group edges every one of `flats` shares, or None when they differ."""
    first = _edges(flats[0])
    return first if all(_edges(f) == first for f in flats) else None


def _edges(flat: LazyTensor) -> tuple[int, ...]:
    """Where the stored parts of a rank's flat start and end (a Concat of sub-groups, or one)."""
    if isinstance(flat, Concat):
        return flat._bounds  # noqa: SLF001 - the part edges Concat keeps
    return (0, flat.size)


def _touched(bounds: tuple[int, ...], span: tuple[int, int]) -> int:
    """The parts between `bounds` that `[a, b)` touches."""
    a, b = span
    return bisect.bisect_left(bounds, b) - bisect.bisect_right(bounds, a) + 1
