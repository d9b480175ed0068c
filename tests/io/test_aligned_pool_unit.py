"""`AlignedPool(unit=...)`: requests up to `unit` bytes all get `unit`-sized buffers, so any free
one serves the next request whatever its size (a restore's scratch pool: pieces of 0.25-8 MiB
whose sizes change array to array made 78-98 fresh buffers, 305-347 MiB, where its limit holds 64
MiB). Counted, not timed."""

from __future__ import annotations

import numpy as np

from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.io.direct_io import DIRECT_ALIGN

MIB = 1 << 20


def test_any_size_up_to_the_unit_reuses_the_same_buffers():
    pool = AlignedPool(4 * MIB, unit=MIB)
    sizes = [4096, MIB, 300_000, 7 * 4096 + 5, MIB - 1, 65536] * 5
    for n in sizes:
        with pool.lend((n,), np.uint8) as a, pool.lend((n // 4,), np.float32) as b:
            assert a.nbytes == n and b.nbytes == n // 4 * 4
            assert a.ctypes.data % DIRECT_ALIGN == 0 and b.ctypes.data % DIRECT_ALIGN == 0
            a[:] = 7
            b[:] = 1.5
    assert pool.allocations == 2  # two lent at a time, whatever the sizes
    plain = AlignedPool(4 * MIB)  # without a unit: matched within 2x, so sizes far apart make new ones
    for n in sizes:
        with plain.lend((n,), np.uint8), plain.lend((n // 4,), np.float32):
            pass
    assert plain.allocations > 2


def test_larger_requests_and_trim():
    pool = AlignedPool(8 * MIB, unit=MIB)
    with pool.lend((3 * MIB,), np.uint8) as big, pool.lend((MIB // 2,), np.uint8) as small:
        assert big.nbytes == 3 * MIB and small.nbytes == MIB // 2
    assert pool.allocations == 2
    pool.trim()  # the 3 MiB one dropped, the unit one kept
    with pool.lend((1000,), np.uint8):
        pass
    assert pool.allocations == 2
    with pool.lend((3 * MIB,), np.uint8):
        pass
    assert pool.allocations == 3
    pool.clear()
    with pool.lend((1000,), np.uint8):
        pass
    assert pool.allocations == 4
    assert pool._held <= pool.limit


def test_the_limit_still_bounds_what_it_keeps():
    pool = AlignedPool(2 * MIB, unit=MIB)
    outs = [pool.borrow((4096,), np.uint8) for _ in range(5)]  # 5 lent at once: past the limit
    for _, give in outs:
        give()
    assert pool.allocations == 5 and pool._held <= 2 * MIB and len(pool._free) == 2


def test_the_buffer_given_back_last_is_lent_first():
    """Of equal free buffers the one given back last is lent (its lines likely still cached: a
    restore's scratch piece is read into and copied out of at once); it was the first."""
    for pool in (AlignedPool(8 * MIB, unit=MIB), AlignedPool(8 * MIB)):
        a, give_a = pool.borrow((MIB,), np.uint8)
        b, give_b = pool.borrow((MIB,), np.uint8)
        give_a()
        give_b()
        again, give = pool.borrow((MIB // 2 if pool.unit else MIB,), np.uint8)
        assert again.ctypes.data == b.ctypes.data and pool.reuses == 1
        give()
