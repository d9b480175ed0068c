"""Lazy global tensors: a global shape, a dtype, and `read_box(box)` that reads only that box.

A box is a tuple of `(start, stop)` pairs, one per dimension, in global element coordinates.
Every source format describes its tensors as compositions of the views below; nothing is read
until a box is asked for, and each view asks its inputs only for the boxes it needs.

Every view also has `read_into(box, out)`, which fills a caller's preallocated array (C-order
or a strided view of one): chains of stored pieces, concatenations, stacks and slices land in one
buffer with no intermediate copies (`read_box` allocates that buffer and calls it).

`file_runs(box, limit)` says where a box's bytes already lie in files, in C order, when a view
only rearranges stored bytes (concatenations, stacks, slices, reshapes; not casts, transposes or
in-memory arrays): an export then copies those runs file to file (`SequentialFile.copy_run`)
instead of materialising the tensor (`copy_runs` picks the tensors worth it).

Views:
- `ArrayTensor`    an in-memory numpy array.
- `StoredTensor`   C-contiguous bytes at an offset of a file (one pread per contiguous run).
- `Concat`         parts joined along an axis (tensor-parallel shards, pipeline chunks).
- `Stack`          parts stacked on a new axis (layers).
- `Slice`          a box of another tensor (vocab trim, one third of a fused qkv).
- `Transpose`      axes permuted (`[out, in]` to `[in, out]`).
- `Reshape`        the same elements in C order under another shape (a flat 1-D range split
                   across ranks, then reshaped: ZeRO, Megatron distributed optimizer, Paddle v2).
- `Take`           indices along an axis (RoPE row permutation).
- `Cast`           another dtype.
- `Bitcast`        the same bytes viewed as another dtype of the same itemsize.
- `Scaled`         times a float32 factor, computed in float32 (a reparameterization).
- `Shifted`        plus a float32 offset, computed in float32 (a zero-centred norm weight).

Modules (each imports only those above it):
- `box`            `Box` and pure box arithmetic (shapes, C-order runs and ranges, block overlaps).
- `base`           the `LazyTensor` protocol, `Deferred` (found on first read), `FileRun`,
                   `copy_into`.
- `runs`           file runs of tilings and joins; `copy_runs`.
- `stored`         the leaves: `ArrayTensor`, `StoredTensor`.
- `span_runs`      a reshaped 1-D range's box read from its span's file runs, a `read_runs`
                   per file (a bucket cut between DP ranks' files), not a read a row.
- `views`          `Slice`, `Concat`, `Stack`, `Transpose`, `Reshape`, `Take`, `Bitcast`, `Cast`.
- `scaled`         `Scaled`: times a float32 factor (MaxText's pre-scaled query kernel);
                   `Shifted`: plus an offset (Megatron's zero-centred gated norm).
- `constructors`   `as_lazy`, `cast`, `transpose`, `reshape`, `slice_axis`, `index0`, `index0_all`, `concat`,
                   `split`: views with no-ops and chains folded.
- `strided`        `stored_strided`: torch's `(shape, strides, storage_offset)` views of a storage.
- `tiled`          `Tiled`: a global tensor of blocks at their offsets (DCP chunks, store chunks).
- `dtypes`         stored dtypes and `--dtype`: `cast_floating` (floating tensors only, with a
                   `CastReport` of what it cast), `Dequantized` (a dequantized tensor's stored
                   dtype over its exact values) (not re-exported: `from hybridckpt.lazy import dtypes`).
- `parallel`       the pool of readers: boxes read in parallel within a byte budget (not
                   re-exported: `from hybridckpt.lazy import parallel`).
"""

from hybridckpt.lazy.base import Deferred, FileRun, LazyTensor, copy_into, scalar_value
from hybridckpt.lazy.box import (
    Box,
    block_overlap,
    box_runs,
    box_shape,
    box_slices,
    check_box,
    flat_boxes,
    flat_ranges,
    full_box,
    grid_boxes,
    normalize_box,
    one_run,
    shape_problem,
)
from hybridckpt.lazy.constructors import (
    as_lazy,
    cast,
    concat,
    index0,
    index0_all,
    reshape,
    slice_axis,
    split,
    transpose,
)
from hybridckpt.lazy.runs import copy_runs, join_runs, tiled_file_runs
from hybridckpt.lazy.scaled import Scaled, Shifted
from hybridckpt.lazy.stored import ArrayTensor, StoredTensor
from hybridckpt.lazy.strided import stored_strided
from hybridckpt.lazy.tiled import Tiled, tiled
from hybridckpt.lazy.views import Bitcast, Cast, Concat, Reshape, Slice, Stack, Take, Transpose

__all__ = [
    # boxes
    "Box",
    "block_overlap",
    "box_runs",
    "box_shape",
    "box_slices",
    "check_box",
    "flat_boxes",
    "flat_ranges",
    "full_box",
    "grid_boxes",
    "normalize_box",
    "one_run",
    "shape_problem",
    # the protocol and file runs
    "FileRun",
    "LazyTensor",
    "copy_into",
    "scalar_value",
    "Deferred",
    "copy_runs",
    "join_runs",
    "tiled_file_runs",
    # leaves and views
    "ArrayTensor",
    "StoredTensor",
    "Bitcast",
    "Cast",
    "Concat",
    "Reshape",
    "Scaled",
    "Shifted",
    "Slice",
    "Stack",
    "Take",
    "Tiled",
    "Transpose",
    # constructors
    "as_lazy",
    "cast",
    "concat",
    "index0",
    "index0_all",
    "reshape",
    "slice_axis",
    "split",
    "stored_strided",
    "tiled",
    "transpose",
]
