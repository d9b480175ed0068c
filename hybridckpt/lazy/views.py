"""Views: lazy tensors made of other lazy tensors; each asks its inputs only for the boxes it needs.

- `Slice`          a box of another tensor (vocab trim, one third of a fused qkv).
- `Concat`         parts joined along an axis (tensor-parallel shards, pipeline chunks).
- `Stack`          parts stacked on a new axis (layers).
- `Transpose`      axes permuted (`[out, in]` to `[in, out]`).
- `Reshape`        the same elements in C order under another shape (a flat 1-D range split
                   across ranks, then reshaped: ZeRO, Megatron distributed optimizer, Paddle v2).
- `Take`           indices along an axis (RoPE row permutation).
- `Bitcast`        the same bytes viewed as another dtype of the same itemsize.
- `Cast`           another dtype.

Build them through the constructors in `hybridckpt.lazy.constructors` (`transpose`, `reshape`,
`slice_axis`, ...), which fold no-ops and chains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hybridckpt.errors import FormatError
from hybridckpt.lazy.base import FileRun, LazyTensor, copy_into
from hybridckpt.lazy.box import Box, box_runs, box_shape, check_box, flat_boxes, flat_ranges
from hybridckpt.lazy.runs import join_runs, tiled_file_runs
from hybridckpt.lazy.span_runs import read_rows, span_runs


@dataclass(frozen=True, eq=False)
class Slice(LazyTensor):
    """The box `region` of `src`, re-based at zero."""

    src: LazyTensor
    region: Box
    _shape: tuple[int, ...] = field(init=False, repr=False)  # the region's, once (asked by the 10k)

    def __post_init__(self):
        check_box(self.src.shape, self.region)
        object.__setattr__(self, "_shape", box_shape(self.region))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self.src.dtype

    def _shift(self, box: Box) -> Box:
        return tuple((r0 + a, r0 + b) for (a, b), (r0, _) in zip(box, self.region, strict=True))

    def read_box(self, box: Box) -> np.ndarray:
        return self.src.read_box(self._shift(box))

    def read_into(self, box: Box, out: np.ndarray) -> None:
        self.src.read_into(self._shift(box), out)

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        return self.src.file_runs(self._shift(box), limit)


@dataclass(frozen=True, eq=False)
class Concat(LazyTensor):
    """`parts` joined along `axis`; all other dimensions and the dtype must agree."""

    parts: tuple[LazyTensor, ...]
    axis: int
    _bounds: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        if not self.parts:
            raise ValueError("Concat needs at least one part")
        ref = self.parts[0]
        rs, rt = ref.shape, np.dtype(ref.dtype)  # each part's shape once (a view computes it)
        ax = self.axis % len(rs)
        object.__setattr__(self, "axis", ax)
        bounds = [0]
        for p in self.parts:
            ps = p.shape
            if len(ps) != len(rs) or any(ps[i] != rs[i] for i in range(len(rs)) if i != ax):
                raise FormatError(
                    f"cannot concatenate shapes {[q.shape for q in self.parts]} on axis {ax}"
                )
            if p.dtype is not rt and np.dtype(p.dtype) != rt:
                raise FormatError(
                    f"cannot concatenate dtypes {[str(q.dtype) for q in self.parts]}"
                )
            bounds.append(bounds[-1] + ps[ax])
        object.__setattr__(self, "_bounds", tuple(bounds))

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.parts[0].shape)
        s[self.axis] = self._bounds[-1]
        return tuple(s)

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """Each overlapping part fills its own slab of `out` (no concatenate copy)."""
        a, b = box[self.axis]
        for p, lo, hi in zip(self.parts, self._bounds[:-1], self._bounds[1:], strict=True):
            s, e = max(a, lo), min(b, hi)
            if s < e:
                sub = list(box)
                sub[self.axis] = (s - lo, e - lo)
                where = [slice(None)] * len(box)
                where[self.axis] = slice(s - a, e - a)
                p.read_into(tuple(sub), out[tuple(where)])

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        pieces = []
        for p, lo in zip(self.parts, self._bounds[:-1], strict=True):
            offs = [0] * len(box)
            offs[self.axis] = lo
            pieces.append((offs, p))
        return tiled_file_runs(box, pieces, limit)


@dataclass(frozen=True, eq=False)
class Stack(LazyTensor):
    """`parts` (same shape and dtype) stacked on a new leading axis: shape `[n, *part.shape]`."""

    parts: tuple[LazyTensor, ...]

    def __post_init__(self):
        if not self.parts:
            raise ValueError("Stack needs at least one part")
        shapes = {p.shape for p in self.parts}
        dtypes = {np.dtype(p.dtype) for p in self.parts}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise FormatError(
                f"cannot stack parts of shapes {sorted(shapes)} and dtypes {sorted(map(str, dtypes))}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts),) + self.parts[0].shape

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    def read_into(self, box: Box, out: np.ndarray) -> None:
        a, b = box[0]
        for i in range(a, b):
            self.parts[i].read_into(box[1:], out[i - a])

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        a, b = box[0]
        return join_runs((self.parts[i].file_runs(box[1:], limit) for i in range(a, b)), limit)


@dataclass(frozen=True, eq=False)
class Transpose(LazyTensor):
    """`src` with axes permuted: output axis i is `src` axis `perm[i]` (numpy semantics)."""

    src: LazyTensor
    perm: tuple[int, ...]

    def __post_init__(self):
        if sorted(self.perm) != list(range(self.src.ndim)):
            raise ValueError(f"bad permutation {self.perm} for shape {self.src.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.src.shape[p] for p in self.perm)

    @property
    def dtype(self) -> np.dtype:
        return self.src.dtype

    def _src_box(self, box: Box) -> Box:
        src_box: list = [None] * len(self.perm)
        for i, p in enumerate(self.perm):
            src_box[p] = box[i]
        return tuple(src_box)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """The source fills a transposed view of `out`: a chain of transposes (import then
        export: `[out, in]` -> `[in, out]` -> `[out, in]`) cancels, and a single one becomes one
        tiled copy at the bottom of the chain."""
        inverse = tuple(int(i) for i in np.argsort(self.perm))
        self.src.read_into(self._src_box(box), out.transpose(inverse))

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        """Only when the box's dims longer than 1 keep their order (the C order is unchanged)."""
        moved = [p for p, (a, b) in zip(self.perm, box, strict=True) if b - a > 1]
        if moved != sorted(moved):
            return None
        return self.src.file_runs(self._src_box(box), limit)


@dataclass(frozen=True, eq=False)
class Reshape(LazyTensor):
    """The elements of `src` in C order, under `shape` (same element count)."""

    src: LazyTensor
    shape: tuple[int, ...]

    def __post_init__(self):
        if math.prod(self.shape) != self.src.size:
            raise FormatError(
                f"cannot reshape {self.src.shape} ({self.src.size} elements) to {self.shape}"
            )

    @property
    def dtype(self) -> np.dtype:
        return self.src.dtype

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        return self.src.read_flat(start, stop)

    def _unit_box(self, box: Box) -> Box | None:
        """When the reshape only adds or drops size-1 dims: the source box of `box`."""
        mine = [(n, b) for n, b in zip(self.shape, box, strict=True) if n != 1]
        if [n for n, _ in mine] != [n for n in self.src.shape if n != 1]:
            return None
        it = iter(b for _, b in mine)
        return tuple((0, 1) if n == 1 else next(it) for n in self.src.shape)

    def _stored_span(self, box: Box) -> LazyTensor | None:
        """This reshape as a stored tensor for reading `box`, when the source's bytes from the box's
        first element to its last (C order) are one run of a file, not our store's (a parameter
        inside a Megatron optimizer bucket, a ZeRO flat): the box is then read as a stored
        tensor's (close runs in one span, runs far apart in one call) instead of one `read_flat`
        through the views a row (~100 us each: a torch_dist import's bucket views cut by a fsdp
        mesh are millions of rows). A box that is one run too (a whole parameter of a bucket, or
        whole rows of it): a stored tensor's box is read straight into `out`, where `read_flat`
        read it into a fresh array, copied that into a second one, then (`out` a transposed tile)
        copied that again. Only the pieces of the source under that span are asked."""
        from hybridckpt.lazy.stored import StoredTensor

        if len(self.src.shape) != 1:
            return None
        starts, run_len = box_runs(self.shape, box)
        lo, hi = int(starts[0]), int(starts[-1]) + run_len
        runs = self.src.file_runs(((lo, hi),), 1)
        item = np.dtype(self.dtype).itemsize
        if not runs or len(runs) != 1 or runs[0].check is not None or runs[0].nbytes != (hi - lo) * item:
            return None
        # element `lo` sits at the run's first byte; the stored tensor reads only the box's runs
        return StoredTensor(runs[0].source, runs[0].offset - lo * item, self.shape, np.dtype(self.dtype))

    def read_into(self, box: Box, out: np.ndarray) -> None:
        if out.size == 0:
            return
        src_box = self._unit_box(box)
        if src_box is not None:  # a view of `out` under the source's unit dims, no copy
            view = out.reshape(box_shape(src_box))
            if np.shares_memory(view, out):
                self.src.read_into(src_box, view)
                return
        stored = self._stored_span(box)
        if stored is not None:
            stored.read_into(box, out)
            return
        if out.flags.c_contiguous:
            self._runs_into(box, out)
        else:
            tmp = np.empty(out.shape, dtype=self.dtype)
            self._runs_into(box, tmp)
            copy_into(out, tmp)

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        if any(b <= a for a, b in box):
            return []
        src_box = self._unit_box(box)
        if src_box is not None:
            return self.src.file_runs(src_box, limit)
        ranges = flat_ranges(self.shape, box, limit)
        if ranges is None:
            return None
        boxes = (b for s, e in ranges for b in flat_boxes(self.src.shape, s, e))
        return join_runs((self.src.file_runs(b, limit) for b in boxes), limit)

    def _runs_into(self, box: Box, out: np.ndarray) -> None:
        """Fill the C-contiguous `out`: from the file runs of the box's span in the 1-D source
        (a bucket cut between files) by a `read_runs` call per file (`lazy.span_runs`; a box of
        one run that crosses the cut too: a read per piece, straight into `out`); else run by run
        through the source's views (runs that touch merged into one read)."""
        starts, run_len = box_runs(self.shape, box)
        if len(self.src.shape) == 1:
            lo, hi = int(starts[0]), int(starts[-1]) + run_len
            runs = span_runs(self.src, lo, hi)
            if runs is not None:
                item = np.dtype(self.dtype).itemsize
                read_rows(runs, lo, starts, run_len, item, out.reshape(-1).view(np.uint8))
                return
        flat = out.reshape(-1)
        pos, i, n = 0, 0, len(starts)
        while i < n:
            j = i + 1
            while j < n and starts[j] == starts[j - 1] + run_len:
                j += 1
            length = (j - i) * run_len
            flat[pos : pos + length] = self.src.read_flat(int(starts[i]), int(starts[i]) + length)
            pos += length
            i = j


@dataclass(frozen=True, eq=False)
class Take(LazyTensor):
    """`src` indexed by `indices` along `axis` (output row i is source row `indices[i]`).

    A box reads the hull of the rows it needs: exact when a box's rows are a permutation of a
    contiguous range (RoPE permutations over whole heads).
    """

    src: LazyTensor
    axis: int
    indices: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.src.shape)
        s[self.axis] = len(self.indices)
        return tuple(s)

    @property
    def dtype(self) -> np.dtype:
        return self.src.dtype

    def read_box(self, box: Box) -> np.ndarray:
        a, b = box[self.axis]
        idx = np.asarray(self.indices[a:b], dtype=np.int64)
        if idx.size == 0:
            return np.empty(box_shape(box), dtype=self.dtype)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        sub = list(box)
        sub[self.axis] = (lo, hi)
        hull = self.src.read_box(tuple(sub))
        return np.ascontiguousarray(np.take(hull, idx - lo, axis=self.axis))


@dataclass(frozen=True, eq=False)
class Bitcast(LazyTensor):
    """`src` with each element's bytes viewed as `dtype` of the same itemsize (bf16 <-> uint16
    bits); no value changes."""

    src: LazyTensor
    dtype: np.dtype

    def __post_init__(self):
        if np.dtype(self.src.dtype).itemsize != np.dtype(self.dtype).itemsize:
            raise FormatError(f"cannot view {self.src.dtype} as {self.dtype}: item sizes differ")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    def read_box(self, box: Box) -> np.ndarray:
        return np.ascontiguousarray(self.src.read_box(box)).view(self.dtype)

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        return self.src.file_runs(box, limit)


@dataclass(frozen=True, eq=False)
class Cast(LazyTensor):
    """`src` converted to `dtype` (numpy `astype`, round-to-nearest-even for bf16)."""

    src: LazyTensor
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    def read_box(self, box: Box) -> np.ndarray:
        return self.src.read_box(box).astype(self.dtype)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        copy_into(out, self.src.read_box(box))  # the same rounding as astype

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        return self.src.read_flat(start, stop).astype(self.dtype)
