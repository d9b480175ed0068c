"""Small pages for the arrays a restore fills (issue 42): `madvise(MADV_NOHUGEPAGE)`.

numpy asks for transparent huge pages on every array of 4 MiB or more (`madvise(MADV_HUGEPAGE)`
at allocation), so with `/sys/kernel/mm/transparent_hugepage/enabled` at `madvise` (the
default of most distributions) a restored shard's first touch faults in 2 MiB pages, each zeroed
whole by the kernel (`folio_zero_user` -> `clear_page_erms`) before the read or copy writes it.
Measured on the 2-core VM of docs/benchmarks.md ("Run 6 of the restore"), 1.1 GB preadv'd from
the page cache into one fresh buffer: 0.97-1.50 system CPU-s with huge pages, 0.64-0.80 with 4
KiB pages (the zeroing of a 2 MiB page runs out of the CPU cache before the copy fills it; a 4
KiB page is zeroed and filled while cached), and `clear_page_erms` 37-43% of a warm restore's
CPU samples. And on a VM whose balloon reports free memory to the host (`virtio_balloon`'s free
page reporting), a huge page is carved from a reported 2 MiB block whose first touch also takes the
host's faults: 1.7-2.2 CPU-s a GiB populated after a few seconds idle, against 0.30 for 4 KiB pages
(docs/benchmarks.md, "The cold restore on a quiet VM"). `no_huge_pages` marks the allocation of an array small before its first touch
(no mapping more than numpy's own mark made): nothing is read, mapped or moved; where the platform has no `madvise` or the kernel refuses it, the array
is left as it was (it is correct either way: only the cost of its first touch differs).

Their pages are not faulted in ahead of the reads: each is faulted in by the read (the kernel's
copy) or the copy that first writes it. Faulting a fresh array's pages in first by one
`madvise(MADV_POPULATE_WRITE)` a 4 MiB slab (the eighth to twelfth stops) was slower on the 2-core
VM once measured alike (docs/benchmarks.md, "Thirteenth stop"): a 1.1 GB restore 0.52 against
0.48 s warm and 0.87 against 0.75 s cold (medians of 6 alternating), and 1.1 GB read into fresh
memory by 2 threads 0.39 against 0.30 s. With several threads the populating calls took the
same CPU seconds in a longer wall (reading 0.77 GB of pieces into fresh shards, 2 threads: 0.41
CPU-s in 0.33 s populated first, 0.45 CPU-s in 0.23 s faulted by the copies): the threads waited
on each other, not on the CPU.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

PAGE_BYTES = 4096
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", None)
MIN_BYTES = 4 << 20  # smaller arrays: numpy does not ask for huge pages (nothing to undo)
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - a platform without madvise
    _madvise = None


def no_huge_pages(array: np.ndarray) -> bool:
    """Ask the kernel to back `array`'s pages with small pages; True where it agreed (called
    before the array is first written: pages faulted in already stay as they are).

    The range marked is the whole allocation `array` is a view of (numpy's own buffer, which
    numpy marked MADV_HUGEPAGE from its first whole page on), widened to whole pages: so the
    mapping numpy split off for it is turned back whole, and no new mapping is split off (a
    mark on the array's pages alone would leave the allocation's ends apart: one more mapping
    an array, against the kernel's `vm.max_map_count`). The pages so widened into belong to the
    allocator's neighbours at most: small pages there change no byte of them."""
    if _madvise is None or _MADV_NOHUGEPAGE is None or array.nbytes < MIN_BYTES:
        return False
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.base is None and root.flags.owndata:  # (numpy's allocation: its whole extent)
        start, end = root.ctypes.data, root.ctypes.data + root.nbytes
        first, last = start // PAGE_BYTES * PAGE_BYTES, -(-end // PAGE_BYTES) * PAGE_BYTES
    else:  # (another object's buffer: only the pages inside the array)
        start, end = array.ctypes.data, array.ctypes.data + array.nbytes
        first, last = -(-start // PAGE_BYTES) * PAGE_BYTES, end // PAGE_BYTES * PAGE_BYTES
    return last > first and _madvise(first, last - first, _MADV_NOHUGEPAGE) == 0

