"""Fresh arrays a restore fills are backed by 4 KiB pages, not the transparent huge pages numpy
asks for on arrays of 4 MiB or more (`io.page_advice`, issue 42: on the 2-core VM the kernel's
zeroing of 2 MiB pages was 37-43% of a warm restore's CPU samples). Checked in
`/proc/self/smaps`, never timed: the mapping holding the array carries the kernel's `nh` flag
(MADV_NOHUGEPAGE), and once the array is written none of its bytes sit in huge pages.

And their pages are faulted in by the reads that fill them, not ahead of them
(`lazy.parallel.read_box_parallel`; faulting them in first by `MADV_POPULATE_WRITE` measured
slower, thirteenth stop): counted with `mincore(2)`, the pages resident when a box's read starts
(none) and after it (all)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
from fixtures.smaps import mapping_of

from hybridckpt.io import page_advice
from hybridckpt.io.direct_io import aligned_empty


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def in_fresh_process(check: str) -> None:
    """Run this module's `check` in a new interpreter: what the kernel backs an array with depends
    on the heap's history (memory an earlier array faulted in as huge pages keeps them, and the
    kernel merges neighbouring mappings), so a worker that ran other tests cannot tell."""
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, here, os.environ.get("PYTHONPATH", "")])}
    code = f"import test_page_advice as t; t.{check}()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_an_array_marked_before_it_is_written_gets_no_huge_page():
    in_fresh_process("check_marked_array")


def test_many_marked_arrays_add_no_mapping():
    in_fresh_process("check_many_marked_arrays")


def check_marked_array():
    a = aligned_empty((16 << 20,), np.uint8)  # (numpy asks huge pages for it: the mapping says "hg")
    before = mappings()
    assert page_advice.no_huge_pages(a)
    assert mappings() <= before  # (numpy's mapping turned back whole: none split off for the mark)
    a[:] = 7  # (every page faulted in now)
    m = mapping_of(a.ctypes.data)
    assert "nh" in m["flags"] and "hg" not in m["flags"], m
    assert m["huge_kb"] == 0, m
    assert mapping_of(a.ctypes.data + a.nbytes - 1)["range"] == m["range"]  # (the whole array, one mapping)
    assert int(a.sum(dtype=np.int64)) == 7 * a.size  # (the array is as written)


def check_many_marked_arrays():
    """Each mark covers the whole allocation numpy made (and split off its mapping for): a
    restore of thousands of shards must not add a mapping a shard (`vm.max_map_count`)."""
    arrays = [aligned_empty((5 << 20,), np.uint8) for _ in range(40)]
    before = mappings()
    assert all(page_advice.no_huge_pages(a) for a in arrays)
    assert mappings() <= before
    for a in arrays:
        a[:] = 1
        assert "nh" in mapping_of(a.ctypes.data)["flags"]


def test_small_arrays_are_left_alone():
    """Under MIN_BYTES numpy asks for no huge page, and a madvise would split the heap's mapping
    for nothing (a restore of many small arrays would multiply mappings)."""
    a = aligned_empty((page_advice.MIN_BYTES // 2,), np.uint8)
    assert not page_advice.no_huge_pages(a)


def resident_pages(a: np.ndarray) -> tuple[int, int]:
    """(pages of `a` resident in memory, pages of `a`) by `mincore(2)`; `a` page-aligned."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-a.nbytes // page_advice.PAGE_BYTES)
    vec = (ctypes.c_ubyte * pages)()
    assert a.ctypes.data % page_advice.PAGE_BYTES == 0
    assert libc.mincore(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def test_a_box_read_fills_a_buffer_whose_pages_its_reads_fault_in():
    in_fresh_process("check_box_read_faults_its_pages")


def check_box_read_faults_its_pages():
    """Each box a restore reads is a fresh 4 KiB-aligned buffer whose pages are not faulted in
    before the read starts, in the thread that reads it (one box whole, and a box read in 4
    pieces by the pool: each piece's pages); the read that writes them faults them in. (From the
    eighth to the twelfth stop every page was resident when the read started: populated first,
    one `MADV_POPULATE_WRITE` a slab.)"""
    from hybridckpt.lazy import LazyTensor, parallel

    class Seen(LazyTensor):
        def __init__(self, shape):
            self.shape, self.dtype, self.seen = shape, np.dtype(np.float32), []

        def read_into(self, box, out):
            before = resident_pages(out)
            out[...] = box[0][0] + 1
            self.seen.append((before, resident_pages(out)))

    parallel.set_io_threads(4)
    one = Seen((1024, 1024))  # 4 MiB: read in one piece
    a = parallel.read_box_parallel(one)
    assert len(one.seen) == 1 and one.seen[0] == ((0, 1024), (1024, 1024)), one.seen
    four = Seen((4096, 2048))  # 32 MiB: 4 pieces of 8 MiB, each read by a pool thread
    b = parallel.read_box_parallel(four)
    assert sorted(four.seen) == [((0, 2048), (2048, 2048))] * 4, four.seen
    assert (a == 1).all() and sorted(set(b[:, 0].tolist())) == [1, 1025, 2049, 3073]  # (each piece written by its read)
