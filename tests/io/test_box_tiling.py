"""The chunk tiling check (`containers.box_tiling`): exact on every input, never pair by pair.

A hostile DCP `.metadata` can list 100k chunks whose cut points draw a grid of billions of cells
(every row of a matrix cut at its own column): the check used to fall back to comparing chunks
pair by pair (5e9 pairs). These tilings, overlaps and gaps hidden in them, pinwheels no cut
separates, and a random corpus checked against painting every element, pin the replacement."""

from __future__ import annotations

import numpy as np
import pytest

from hybridckpt.containers import box_tiling
from hybridckpt.containers.box_tiling import check_boxes
from hybridckpt.errors import FormatError


def rows_cut(rows: int, width: int, seed: int = 0):
    """Every row of a `[rows, width]` matrix cut in two at its own column: 2 x rows chunks,
    a grid of about rows x 2 rows cells. Returns shape, offsets, sizes (`[n, 2]` int64)."""
    rng = np.random.default_rng(seed)
    cut = rng.choice(np.arange(1, width), size=rows, replace=False)
    off = np.zeros((2 * rows, 2), np.int64)
    size = np.ones((2 * rows, 2), np.int64)
    off[0::2, 0] = off[1::2, 0] = np.arange(rows)
    size[0::2, 1] = cut
    off[1::2, 1] = cut
    size[1::2, 1] = width - cut
    return (rows, width), off, size


def pinwheel(r0: int, c0: int, h: int, w: int):
    """Five boxes tiling `[r0, r0 + 3h) x [c0, c0 + 3w)` that no straight cut separates."""
    boxes = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))]
    off = np.array([(r0 + a * h, c0 + b * w) for (a, b), _ in boxes], np.int64)
    size = np.array([(x * h, y * w) for _, (x, y) in boxes], np.int64)
    return off, size


def test_a_100k_chunk_hostile_tiling_is_checked_by_cuts_without_painting_its_grid(monkeypatch):
    """The work, not the time (the pair-by-pair check took minutes here, the cuts 0.2 s: see the
    commit): the 2.5e9-cell grid is never painted; the cuts split it, painting at most a few
    cells a chunk."""
    shape, off, size = rows_cut(50_000, 1 << 20)
    assert box_tiling.grid_cells(off, off + size, box_tiling.GRID_LIMIT) > box_tiling.GRID_LIMIT  # not the painted grid
    painted, by_cuts = [], []
    real_grid, real_cuts = box_tiling.overlap_grid, box_tiling._by_cuts

    def counted_grid(lo, hi):
        painted.append(box_tiling.grid_cells(lo, hi, 1 << 62))
        return real_grid(lo, hi)

    def counted_cuts(*a):
        by_cuts.append(1)
        return real_cuts(*a)

    monkeypatch.setattr(box_tiling, "overlap_grid", counted_grid)
    monkeypatch.setattr(box_tiling, "_by_cuts", counted_cuts)
    check_boxes("w", shape, off, size, "x.metadata")
    assert by_cuts == [1]
    assert sum(painted) <= 16 * len(off)


def test_an_overlap_hidden_in_the_hostile_tiling_is_named():
    shape, off, size = rows_cut(50_000, 1 << 20)
    k = 2 * 31_337 + 1  # the right half of row 31337 moved one column left: as many elements
    off[k, 1] -= 1
    with pytest.raises(FormatError, match=r"^x\.metadata: 'w' chunks overlap: offsets \(31337, \d+\)") as e:
        check_boxes("w", shape, off, size, "x.metadata")
    assert str(e.value).count("offsets (31337,") == 2


def test_a_gap_hidden_in_the_hostile_tiling_is_named():
    shape, off, size = rows_cut(50_000, 1 << 20)
    size[2 * 777 + 1, 1] -= 1
    with pytest.raises(FormatError, match=r"cover \d+ of \d+ elements of shape \(50000, 1048576\): a gap"):
        check_boxes("w", shape, off, size, "x.metadata")


def test_a_gap_and_an_overlap_of_equal_size_are_caught():
    shape, off, size = rows_cut(50_000, 1 << 20)
    size[2 * 10 + 1, 1] -= 1  # row 10 one element short
    size[2 * 20, 1] += 1  # row 20's left half one element into its right half
    with pytest.raises(FormatError, match=r"gap in the region at offsets \(10, \d+\)|overlap: offsets \(20, 0\)"):
        check_boxes("w", shape, off, size, "x.metadata")


def test_a_pinwheel_no_cut_separates_is_painted_and_passes():
    shape, off, size = rows_cut(50_000, 3 << 18)
    po, ps = pinwheel(50_000, 0, 2, 1 << 18)
    shape = (50_006, 3 << 18)
    check_boxes("w", shape, np.concatenate([off, po]), np.concatenate([size, ps]), "x.metadata")
    po[4, 1] += 1  # the centre pushed into its right neighbour (and a gap on its left)
    with pytest.raises(FormatError, match=r"chunks overlap: offsets \(50002, 524288\) .* and offsets \(50002, 262145\) sizes \(2, 262144\)"):
        check_boxes("w", shape, np.concatenate([off, po]), np.concatenate([size, ps]), "x.metadata")


def test_cuts_nested_deeper_than_any_writer_are_refused_in_one_line():
    """A staircase: a column, then a row of what is left, then a column, ...: valid, but each
    level peels off one chunk, so it would take n levels; refused after `max_levels`."""
    n = 10_000  # a grid of 5001 x 5001 cells: past GRID_LIMIT, so the cuts check
    off, size = [], []
    r = c = 0
    side = 100_000
    for i in range(n):
        if i % 2 == 0:
            off.append((r, c)), size.append((side - r, 1))
            c += 1
        else:
            off.append((r, c)), size.append((1, side - c))
            r += 1
    off.append((r, c)), size.append((side - r, side - c))
    off, size = np.array(off, np.int64), np.array(size, np.int64)
    with pytest.raises(FormatError, match=r"^x: 'w' 10001 chunks nest their cuts more than 12 levels deep") as e:
        check_boxes("w", (side, side), off, size, "x")
    assert "\n" not in str(e.value)


def _paint(shape, off, size) -> str:
    """The brute-force oracle: every element counted."""
    count = np.zeros(shape, np.int32)
    for o, s in zip(off, size, strict=True):
        count[tuple(slice(a, a + b) for a, b in zip(o, s, strict=True))] += 1
    if (count > 1).any():
        return "overlap"
    return "gap" if (count == 0).any() else "ok"


def _random_tiling(rng, shape):
    """Random guillotine splits, a pinwheel now and then."""
    boxes = [(np.zeros(len(shape), np.int64), np.array(shape, np.int64))]
    out = []
    while boxes:
        lo, hi = boxes.pop()
        ext = hi - lo
        if len(shape) == 2 and (ext % 3 == 0).all() and rng.random() < 0.3:
            po, ps = pinwheel(int(lo[0]), int(lo[1]), int(ext[0]) // 3, int(ext[1]) // 3)
            out += list(zip(po, ps, strict=True))
            continue
        d = int(rng.integers(len(shape)))
        if ext[d] < 2 or rng.random() < 0.25:
            out.append((lo, ext))
            continue
        k = int(rng.integers(1, ext[d]))
        a_hi, b_lo = hi.copy(), lo.copy()
        a_hi[d] = b_lo[d] = lo[d] + k
        boxes += [(lo, a_hi), (b_lo, hi)]
    return np.array([o for o, _ in out], np.int64), np.array([s for _, s in out], np.int64)


@pytest.mark.parametrize("seed", range(40))
def test_random_tilings_and_damage_agree_with_painting(seed, monkeypatch):
    """Valid tilings, and each with one chunk moved, shrunk or grown, judged by the cuts check
    (the painted-grid path turned off) exactly as painting every element judges them."""
    monkeypatch.setattr(box_tiling, "GRID_LIMIT", 4)
    rng = np.random.default_rng(seed)
    shape = tuple(int(x) for x in rng.integers(6, 24, size=int(rng.integers(1, 4))))
    off, size = _random_tiling(rng, shape)
    cases = [(off, size)]
    for _ in range(6):
        o, s = off.copy(), size.copy()
        k, d = int(rng.integers(len(o))), int(rng.integers(len(shape)))
        how = rng.integers(3)
        if how == 0 and o[k, d] > 0:
            o[k, d] -= 1
        elif how == 1 and s[k, d] > 1:
            s[k, d] -= 1
        elif o[k, d] + s[k, d] < shape[d]:
            s[k, d] += 1
        cases.append((o, s))
    for o, s in cases:
        want = _paint(shape, o, s)
        try:
            check_boxes("w", shape, o, s, "x")
            got = "ok"
        except FormatError as e:
            got = "overlap" if "overlap" in str(e) else "gap" if "gap" in str(e) else str(e)
        assert got == want or (want != "ok" and got != "ok"), (want, got, o.tolist(), s.tolist())
