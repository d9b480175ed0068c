"""Reads of file ranges the page cache does not hold, with O_DIRECT (issue 42's cold restore).

A buffered read of bytes that are not in the page cache costs the kernel a fresh page-cache page
per 4 KiB, the device read in readahead windows, and a copy into the caller's buffer; with four
reader threads on this 2-core VM that was 196 MB/s a thread (a cold restore's `read` stage: 5.7
busy-s for 1.1 GB, against 0.6 s for the same files read with `O_DIRECT`). `posix_fadvise`
(`WILLNEED`, `SEQUENTIAL`) only starts that same work earlier: measured on the restore's 573 chunk
files, 4 threads into fresh buffers, cold, it took as long as the plain buffered read (2.0-2.7 s
wall, 0.5-0.9 system CPU-s) where `O_DIRECT` took 0.97-1.16 s and 0.21 system CPU-s (load 5-6).
So a large read of a cold range goes from the device straight into the caller's memory.

But a range the page cache holds (a file just written buffered, or read by a restore before)
would be read again from the device. So each read decides by asking the kernel how much of the
range is cached: `cachestat(2)` (Linux 6.5+: counts without mapping the file, unlike `mincore`,
and without reading anything, unlike a `RWF_NOWAIT` probe: its miss returns EAGAIN but starts
a readahead of the range asked, which the device then reads twice, and which makes the next
probe say warm for a file still cold past it). Under half the range's pages cached:
O_DIRECT; else (and on a kernel without cachestat, and for reads under `DIRECT_MIN_BYTES`) the
buffered read as before. A warm restore so costs one more syscall a read.

The alignment O_DIRECT needs comes from the filesystem (`statx` `STATX_DIOALIGN`, Linux 6.1+;
4 KiB where it does not say): the file offset and each buffer's address and length. Buffers that
meet it (the 4 KiB-aligned arrays a restore reads into, `io.direct_io.aligned_empty`, and rows of
them) are read into straight; anything else (an unaligned buffer, rows of odd length, a range's
unaligned ends, a file's tail) goes through a per-thread bounce buffer of `BOUNCE_BYTES` read
with O_DIRECT and copied out (the one copy a buffered read makes anyway, in the kernel).

The O_DIRECT descriptor is opened per read from `/proc/self/fd` of the cached one, so it is the
file the job is reading (`io.open_files`), never what the path names now. A filesystem that
refuses O_DIRECT (tmpfs before Linux 6.6, some network filesystems: EINVAL) is remembered and read
buffered; a read that comes back short (the file shrank) is left to the buffered read, which names
the truncation. Users: `io.byte_source` (`read_into`, `read_scatter`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

from hybridckpt.io.direct_io import DIRECT_ALIGN, aligned_empty

DIRECT_MIN_BYTES = 256 << 10  # smaller reads stay buffered (a syscall and a device round trip each)
BOUNCE_BYTES = 4 << 20  # the per-thread O_DIRECT buffer for what is not aligned (one step of a read)
IOV_MAX = 1024  # buffers per preadv (Linux)
_SYS_CACHESTAT = 451  # the same number on every Linux architecture (added in 6.5)
_STATX_DIOALIGN = 0x2000
_REFUSAL = {errno.EINVAL, errno.EOPNOTSUPP}

_lock = threading.Lock()
_align: dict[int, tuple[int, int] | None] = {}  # st_dev -> (memory, offset) alignment, None: refused
_local = threading.local()  # .bounce: this thread's aligned buffer
_cachestat_ok = [True]  # False once the kernel (or a seccomp filter) refused cachestat


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                               "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(fd: int, offset: int, nbytes: int) -> tuple[int, int] | None:
    """(pages of `[offset, offset + nbytes)` the page cache holds, pages of the range), by
    `cachestat(2)`; None where the kernel cannot say (older than 6.5, or refused)."""
    if not _cachestat_ok[0]:
        return None
    first, last = offset // 4096, (offset + nbytes + 4095) // 4096
    rng, stat = _Range(first * 4096, (last - first) * 4096), _CacheStat()
    if _libc.syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(stat),
                     ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _cachestat_ok[0] = False
        return None
    return int(stat.nr_cache), last - first


def alignment(fd: int) -> tuple[int, int] | None:
    """(memory, file offset) alignment O_DIRECT needs on `fd`'s filesystem (`statx`
    STATX_DIOALIGN; DIRECT_ALIGN both where it does not say), or None where it refused O_DIRECT."""
    dev = os.fstat(fd).st_dev
    with _lock:
        if dev in _align:
            return _align[dev]
    buf = ctypes.create_string_buffer(256)
    got = (DIRECT_ALIGN, DIRECT_ALIGN)
    statx = getattr(_libc, "statx", None)
    if statx is not None and statx(ctypes.c_int(fd), b"", ctypes.c_int(0x1000), ctypes.c_uint(_STATX_DIOALIGN),
                                   buf) == 0:  # (AT_EMPTY_PATH: the open file itself)
        mask, mem, off = (int.from_bytes(buf.raw[a: a + 4], sys.byteorder) for a in (0, 152, 156))  # (struct statx)
        if mask & _STATX_DIOALIGN:
            got = (mem, off) if mem and off else None  # (zeros: this file takes no O_DIRECT)
    with _lock:
        _align.setdefault(dev, got)
        return _align[dev]


def _refuse(fd: int) -> None:
    with _lock:
        _align[os.fstat(fd).st_dev] = None


def is_cold(fd: int, offset: int, nbytes: int) -> bool:
    """Whether a read of `nbytes` at `offset` should bypass the page cache: large enough, and
    under half its pages cached (see the module doc)."""
    if nbytes < DIRECT_MIN_BYTES or not hasattr(os, "O_DIRECT"):
        return False
    got = cached_pages(fd, offset, nbytes)
    return got is not None and 2 * got[0] < got[1]


def read(fd: int, offset: int, views: Sequence[memoryview], total: int | None = None) -> int:
    """Fill `views` in order with the file's bytes from `offset` with O_DIRECT when the range is
    cold (`is_cold`): the bytes so read (all of them), or 0 where it read nothing for certain
    (warm, refused, the file shorter than the range): then the caller reads buffered.
    `total`: the views' bytes where the caller knows them. The range is asked about first, so a
    warm read (every read of an import's page-cache-warm source) makes no pass over its views:
    the 128 staging rows of each strip of a transposed read were walked three times a strip."""
    if total is None:
        total = sum(v.nbytes for v in views)
    if not is_cold(fd, offset, total):
        return 0
    if any(v.readonly or not v.c_contiguous for v in views):
        return 0  # (what the buffered read makes of such a buffer, as before)
    views = [v if v.ndim == 1 and v.format == "B" else v.cast("B") for v in views]
    align = alignment(fd)
    if align is None:
        return 0
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in _REFUSAL:
            _refuse(fd)
        return 0
    try:
        done = _read_aligned(dfd, offset, views, align)
        if done < total:
            flat = _rest(views, done)
            done += _read_bounced(dfd, offset + done, flat, align[1])
        return done if done == total else 0
    except OSError as e:  # (any other error: the buffered read meets it again and names it)
        if e.errno in _REFUSAL:
            _refuse(fd)
        return 0
    finally:
        os.close(dfd)


def _read_aligned(dfd: int, offset: int, views: Sequence[memoryview], align: tuple[int, int]) -> int:
    """Read the longest leading run of `views` O_DIRECT can take as they are (each address and
    length aligned; the last view's aligned head, a contiguous range's file tail left over)
    straight into them; the bytes read (short only at a file's end)."""
    mem, off = align
    if offset % off:
        return 0
    batch: list[memoryview] = []
    for i, v in enumerate(views):
        n = len(v) - len(v) % off
        if _address(v) % mem or n == 0 or (n != len(v) and i != len(views) - 1):
            break  # (rows of an odd length: all through the bounce buffer, not a syscall a row)
        batch.append(v[:n])
    done = 0
    for i in range(0, len(batch), IOV_MAX):
        part = batch[i: i + IOV_MAX]
        want = sum(len(v) for v in part)
        got = os.preadv(dfd, part, offset + done)
        done += got
        if got != want:
            break
    return done


def _rest(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """`views` less their first `skip` bytes."""
    out = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out


def _bounce() -> memoryview:
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = _local.bounce = memoryview(aligned_empty((BOUNCE_BYTES,), np.uint8))
    return buf


def _read_bounced(dfd: int, offset: int, views: list[memoryview], off: int) -> int:
    """Fill `views` from `offset` through the aligned bounce buffer: O_DIRECT reads of whole
    aligned blocks covering the range, `BOUNCE_BYTES` at a time, each copied out into the views;
    the bytes filled (fewer where the file ends first)."""
    bounce, total = _bounce(), sum(len(v) for v in views)
    start = offset - offset % off
    at, vi, vo = offset, 0, 0  # the next file byte to place; the view and its offset it goes to
    while at < offset + total:
        want = min(BOUNCE_BYTES, -(-(offset + total - start) // off) * off)
        got = os.preadv(dfd, [bounce[:want]], start)
        avail = min(start + got, offset + total) - at
        if avail <= 0:
            break
        src = at - start
        while avail:
            n = min(avail, len(views[vi]) - vo)
            views[vi][vo: vo + n] = bounce[src: src + n]
            src, at, avail, vo = src + n, at + n, avail - n, vo + n
            if vo == len(views[vi]):
                vi, vo = vi + 1, 0
        if got < want:
            break
        start += got
    return at - offset


def _address(v: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(v)) if len(v) else 0
