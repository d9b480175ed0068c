"""A chunk a restore read whole and kept for the pieces other threads cut from it
(`store.held_chunks.HeldChunks`) goes back to the pool that lent its buffer only once every piece
taken from it has been cut. The last piece's `take` can come while an earlier piece is still being
copied out: a buffer given back at that take was lent to the next chunk read and overwritten under
the copy (CI, issue 42: an OCDBT restore from a bucket differed from the local one in one AdamW
moment; on a busy 2-core machine one restore in three placed a shard with another chunk's bytes)."""

from __future__ import annotations

import numpy as np

from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.store.held_chunks import HeldChunks


def kept_chunk(pool: AlignedPool, held: HeldChunks, pos: int = 0) -> np.ndarray:
    data, give = pool.borrow((4, 256), np.float32)
    data[...] = np.arange(data.size, dtype=np.float32).reshape(data.shape)
    assert held.keep(pos, data, data.size, give, limit=1 << 20)
    return data.copy()


def test_the_buffer_stays_whole_while_an_earlier_piece_is_still_cut():
    pool, held = AlignedPool(1 << 20), HeldChunks()
    want = kept_chunk(pool, held)
    first, first_done = held.take(0, 512)  # a piece being copied out, its copy not ended
    _, last_done = held.take(0, 512)  # the other half, taken and cut meanwhile
    last_done()
    other, give = pool.borrow((4, 256), np.float32)  # the next chunk read whole, into a lent buffer
    other[...] = -1.0
    assert np.array_equal(first, want)  # (given back at the last take, `other` was this very buffer)
    first_done()
    give()
    assert pool.allocations == 2 and pool.reuses == 0


def test_the_buffer_goes_back_after_the_last_cut():
    pool, held = AlignedPool(1 << 20), HeldChunks()
    before = HeldChunks.budget_used[0]  # (shared by every array of the process: others may hold some)
    kept_chunk(pool, held)
    _, a = held.take(0, 512)
    _, b = held.take(0, 512)
    a()
    b()
    pool.borrow((4, 256), np.float32)
    assert pool.reuses == 1 and pool.allocations == 1  # given back once, and reused
    assert HeldChunks.budget_used[0] == before


def test_clear_while_a_piece_is_cut_gives_the_buffer_back_after_it():
    pool, held = AlignedPool(1 << 20), HeldChunks()
    before = HeldChunks.budget_used[0]
    want = kept_chunk(pool, held)
    piece, done = held.take(0, 100)  # part of the chunk taken; the rest never will be (another host's)
    held.clear()
    assert held.take(0, 100) is None and HeldChunks.budget_used[0] == before
    other, _ = pool.borrow((4, 256), np.float32)
    other[...] = -1.0
    assert np.array_equal(piece, want) and pool.reuses == 0
    done()
    pool.borrow((4, 256), np.float32)
    assert pool.reuses == 1  # back once the cut ended, not lost


def test_a_chunk_in_a_fresh_buffer_needs_no_give():
    held = HeldChunks()
    assert held.keep(3, np.zeros(8), 8, None, limit=1 << 20)
    data, done = held.take(3, 8)
    done()
    assert held.take(3, 1) is None and data.shape == (8,)
