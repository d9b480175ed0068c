"""Whether boxes tile a shape exactly: inside it, no overlap, no gap; in bounded time.

A box is `[lo, hi)` per dim (int64 element offsets, `lo`/`hi` arrays `[boxes, ndim]`). Every
check here is O(n log n) in the number of boxes (times a small factor of dims), or bounded by
`GRID_LIMIT` cells, or refuses the input with one line: nothing compares boxes pair by pair.

- **the grid**: the boxes' cut points per dim draw a grid; if it has at most `GRID_LIMIT` cells,
  each box is a block of cells and the cells are painted with a difference array (the count of
  boxes on each cell): a cell counted twice is an overlap, named by two boxes on it;
- **cuts**: otherwise the boxes are split recursively along cuts no box straddles (sorted by
  their start on one dim, a new part begins where every earlier box ends at or before the next
  start). Each part is a slab of its parent's region: a part of one box must be its region, a
  part no cut separates (an overlap, or a pinwheel) is painted on its own small grid. Every
  tiling torch's planners write (DTensor `Shard` on any dims, uneven last chunks, FSDP2's
  `_StridedShard` over TP, ShardedTensor) and Megatron's flattened ranges (a grid on the leading
  dims, any cuts on the flat one) separate in at most one level per dim.

What is refused, as a FormatError naming the tensor, rather than checked pair by pair: boxes that
nest their cuts more than `MAX_LEVELS` deep, and parts no cut separates whose grids together
exceed `PART_CELLS` cells. No writer we know makes either.
"""

from __future__ import annotations

import math

import numpy as np

from hybridckpt.errors import FormatError

GRID_LIMIT = 1 << 24  # grid cells painted at once (int32 counts: 64 MiB)
PART_CELLS = 1 << 24  # grid cells painted in all, over the parts no cut separates


def max_levels(nd: int) -> int:
    """Levels of cuts followed before a tiling is refused: real tilings need at most `nd` + 1."""
    return 4 * max(nd, 1) + 4


def check_boxes(fqn: str, shape, offsets: np.ndarray, sizes: np.ndarray, where: str) -> None:
    """Boxes `[offsets, offsets + sizes)` (int64 `[n, >= ndim]`, extent 1 past `ndim`) lie inside
    `shape`, do not overlap and cover it; else a FormatError naming `fqn` and two chunks (or the
    region left uncovered)."""
    nd = len(shape)
    shape_a = np.array(shape, dtype=np.int64)
    lo, ext = offsets[:, :nd], sizes[:, :nd]
    bad = np.flatnonzero(((lo + ext) > shape_a).any(axis=1)) if len(lo) else []
    if len(bad):
        r = int(bad[0])
        raise FormatError(
            f"{where}: '{fqn}' chunk at offsets {_tup(lo[r], nd)} sizes {_tup(ext[r], nd)} reaches past "
            f"the global shape {tuple(shape)}"
        )
    live = np.flatnonzero(ext.prod(axis=1) > 0) if nd else np.arange(len(lo))
    lo, hi = lo[live], lo[live] + ext[live]
    total = math.prod(shape)
    covered = int(np.prod(hi - lo, axis=1, dtype=np.int64).sum()) if len(lo) else 0
    if nd == 0 and len(lo) > 1:
        raise FormatError(f"{where}: '{fqn}' chunks overlap: {len(lo)} chunks of a 0-d tensor")
    found = None
    if len(lo) > 1:
        if grid_cells(lo, hi, GRID_LIMIT) <= GRID_LIMIT:
            found = overlap_grid(lo, hi)
        elif covered == total:  # else the count below names the fault without any search
            found = _by_cuts(fqn, lo, hi, shape_a, where)
    if found is not None and found[0] == "overlap":
        i, j = found[1], found[2]
        raise FormatError(
            f"{where}: '{fqn}' chunks overlap: offsets {_tup(lo[i], nd)} sizes {_tup(hi[i] - lo[i], nd)} "
            f"and offsets {_tup(lo[j], nd)} sizes {_tup(hi[j] - lo[j], nd)}"
        )
    if covered != total:
        shown = [_tup(o, nd) for o in offsets[:8]]
        fault = "a gap" if covered < total else "an overlap"
        raise FormatError(
            f"{where}: '{fqn}' chunks at offsets {shown}{' ...' if len(offsets) > 8 else ''} cover "
            f"{covered} of {total} elements of shape {tuple(shape)}: {fault}"
        )
    if found is not None:  # ("gap", region lo, region hi): as many elements, so an overlap too
        rlo, rhi = found[1], found[2]
        raise FormatError(
            f"{where}: '{fqn}' chunks cover {total} elements but leave a gap in the region at offsets "
            f"{_tup(rlo, nd)} sizes {_tup(rhi - rlo, nd)} (and so overlap elsewhere)"
        )


def grid_cells(lo: np.ndarray, hi: np.ndarray, limit: int) -> int:
    """Cells of the grid the boxes' cut points draw (once past `limit`, some number above it)."""
    n = 1
    for d in range(lo.shape[1]):
        n *= len(np.unique(np.concatenate([lo[:, d], hi[:, d]])))
        if n > limit:
            break
    return n


def overlap_grid(lo: np.ndarray, hi: np.ndarray):
    """("overlap", i, j) for two boxes that share a cell of the grid their boundaries draw, or
    None: each box is a block of grid cells; counts per cell come from a difference array summed
    along every dim."""
    nd = lo.shape[1]
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d]])) for d in range(nd)]
    a = [np.searchsorted(cuts[d], lo[:, d]) for d in range(nd)]
    b = [np.searchsorted(cuts[d], hi[:, d]) for d in range(nd)]
    diff = np.zeros([len(c) for c in cuts], dtype=np.int32)
    for corner in range(1 << nd):
        idx = tuple(b[d] if corner >> d & 1 else a[d] for d in range(nd))
        sign = -1 if bin(corner).count("1") % 2 else 1
        np.add.at(diff, idx, sign)
    for d in range(nd):
        np.cumsum(diff, axis=d, out=diff)
    if diff.max(initial=0) <= 1:
        return None
    cell = np.unravel_index(int(np.argmax(diff)), diff.shape)
    inside_ = np.ones(len(lo), dtype=bool)
    for d in range(nd):
        inside_ &= (a[d] <= cell[d]) & (cell[d] < b[d])
    i, j = np.flatnonzero(inside_)[:2].tolist()
    return "overlap", i, j


def _by_cuts(fqn: str, lo: np.ndarray, hi: np.ndarray, shape: np.ndarray, where: str):
    """The cuts check of the module doc: None, ("overlap", i, j) or ("gap", region lo, hi).

    State: `idx` the boxes still in parts of more than one box, `g` their part, `rlo`/`rhi`
    `[parts, nd]` each part's region. A level costs O(nd n log n)."""
    n, nd = lo.shape
    idx = np.arange(n)
    g = np.zeros(n, dtype=np.int64)
    rlo, rhi = np.zeros((1, nd), dtype=np.int64), shape[None, :].copy()
    painted = 0
    for _level in range(max_levels(nd)):
        counts = np.bincount(g, minlength=len(rlo))
        one = counts[g] == 1
        s, sg = idx[one], g[one]
        wrong = np.flatnonzero(((lo[s] != rlo[sg]) | (hi[s] != rhi[sg])).any(axis=1))
        if len(wrong):
            k = int(sg[wrong[0]])
            return "gap", rlo[k], rhi[k]
        idx, g = idx[~one], g[~one]
        if not len(idx):
            return None
        parts = len(rlo)
        chosen = np.full(parts, -1, dtype=np.int64)
        new_lo, new_hi, new_g, new_idx = [], [], [], []
        base = 0
        for d in range(nd):
            a, b = lo[idx, d], hi[idx, d]
            order = np.lexsort((a, g))
            gs, as_, bs = g[order], a[order], b[order]
            cuts = np.unique(np.concatenate([as_, bs]))
            ra, rb = np.searchsorted(cuts, as_), np.searchsorted(cuts, bs)
            span = len(cuts) + 1  # parts x span < 2^63 for any n that fits in memory
            reach = np.maximum.accumulate(gs * span + rb) - gs * span  # furthest end so far, per part
            first = np.ones(len(gs), dtype=bool)
            first[1:] = gs[1:] != gs[:-1]
            start = first.copy()
            start[1:] |= reach[:-1] <= ra[1:]
            splits = np.bincount(gs, weights=start, minlength=parts) > 1
            take = splits & (chosen < 0)
            chosen[take] = d
            sel = take[gs]
            if not sel.any():
                continue
            st, fs, ss, aa = start[sel], first[sel], gs[sel], as_[sel]
            label = np.cumsum(st) - 1 + base
            heads = np.flatnonzero(st)
            pg = ss[heads]  # each new part's parent
            plo, phi = rlo[pg].copy(), rhi[pg].copy()
            plo[:, d] = np.where(fs[heads], rlo[pg, d], aa[heads])
            last = np.ones(len(heads), dtype=bool)
            last[:-1] = pg[1:] != pg[:-1]
            nxt = np.empty(len(heads), dtype=np.int64)
            nxt[:-1] = aa[heads[1:]]
            nxt[-1] = 0
            phi[:, d] = np.where(last, rhi[pg, d], nxt)
            new_lo.append(plo)
            new_hi.append(phi)
            new_g.append(label)
            new_idx.append(idx[order][sel])
            base += len(heads)
        stuck = (chosen < 0)[g]  # no cut separates these parts: paint each on its own grid
        sidx, sg = idx[stuck], g[stuck]
        o = np.argsort(sg, kind="stable")
        sidx, sg = sidx[o], sg[o]
        bounds = np.flatnonzero(np.r_[True, sg[1:] != sg[:-1], True]) if len(sg) else np.zeros(1, np.int64)
        for u, v in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            p, members = int(sg[u]), sidx[u:v]
            painted += grid_cells(lo[members], hi[members], PART_CELLS)
            if painted > PART_CELLS:
                raise FormatError(
                    f"{where}: '{fqn}' {len(members)} chunks in the region at offsets {_tup(rlo[p], nd)} "
                    f"sizes {_tup(rhi[p] - rlo[p], nd)} interlock (no cut separates them) over more than "
                    f"{PART_CELLS} grid cells: not a tiling any known writer makes; refused unchecked"
                )
            hit = overlap_grid(lo[members], hi[members])
            if hit is not None:
                return "overlap", int(members[hit[1]]), int(members[hit[2]])
            vol = int(np.prod(hi[members] - lo[members], axis=1, dtype=np.int64).sum())
            if vol != math.prod(int(x) for x in rhi[p] - rlo[p]):
                return "gap", rlo[p], rhi[p]
        if not new_idx:
            return None
        idx, g = np.concatenate(new_idx), np.concatenate(new_g)
        rlo, rhi = np.concatenate(new_lo), np.concatenate(new_hi)
    raise FormatError(
        f"{where}: '{fqn}' {n} chunks nest their cuts more than {max_levels(nd)} levels deep: not a tiling "
        f"any known writer makes (each dim is cut once per level); refused unchecked"
    )


def _tup(row: np.ndarray, n) -> tuple[int, ...]:
    return tuple(int(x) for x in row[: int(n)])
