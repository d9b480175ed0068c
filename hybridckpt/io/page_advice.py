"""Small pages for the arrays a restore fills (issue 42): `madvise(MADV_NOHUGEPAGE)`; and their
pages faulted in by one call before they are filled: `madvise(MADV_POPULATE_WRITE)`.

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

`populate` then faults a fresh array's pages in by one `madvise(MADV_POPULATE_WRITE)` (Linux
5.14+) before the reads and copies fill it. Each page is still allocated, zeroed and charged,
but in one pass of the kernel's fault-in loop rather than one page-fault exception a page taken
in the middle of a copy (a cold restore's `cut` copies into fresh shards were 37% of its CPU
samples, mostly `exc_page_fault`). Measured on the 2-core VM (load ~8), 512 MiB of fresh 4 KiB
pages filled by 8 MiB copies: 0.35-0.41 CPU-s faulted by the copy, 0.23-0.27 CPU-s populated
first then copied. No byte of the array changes (the kernel only maps zeroed pages where none
were); where the kernel has no MADV_POPULATE_WRITE (EINVAL) or cannot (ENOMEM), nothing is
done and the first touch faults the pages in as before.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys

import numpy as np

PAGE_BYTES = 4096
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", None)
MIN_BYTES = 4 << 20  # smaller arrays: numpy does not ask for huge pages (nothing to undo)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
# (23: Linux's value on every architecture; Python before 3.13 lacks the name)
POPULATE_MIN_BYTES = 64 << 10  # smaller arrays: a syscall saves less than it costs
_populate_ok = [True]  # False once the kernel refused MADV_POPULATE_WRITE (EINVAL: older than 5.14)

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


def populate(array: np.ndarray) -> bool:
    """Fault in every page holding a byte of `array` (C-contiguous, writable) by one
    `madvise(MADV_POPULATE_WRITE)`; True where the kernel did. Call on a fresh array, in the
    thread that then fills it, before it is first written (pages present already are left as
    they are; no byte changes). False, doing nothing, for an array under `POPULATE_MIN_BYTES`,
    one not contiguous or read-only, and where the kernel lacks or refuses it."""
    if (_madvise is None or _MADV_POPULATE_WRITE is None or not _populate_ok[0] or array.nbytes < POPULATE_MIN_BYTES
            or not array.flags.c_contiguous or not array.flags.writeable):
        return False
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    first, last = start // PAGE_BYTES * PAGE_BYTES, -(-end // PAGE_BYTES) * PAGE_BYTES
    if _madvise(first, last - first, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:  # (no such advice on this kernel: not asked again)
        _populate_ok[0] = False
    return False
