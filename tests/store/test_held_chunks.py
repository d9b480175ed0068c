"""A chunk a restore read whole and kept for the pieces other threads cut from it
(`store.held_chunks.HeldChunks`) goes back to the pool that lent its buffer only once every piece
taken from it has been cut. The last piece's `take` can come while an earlier piece is still being
copied out: a buffer given back at that take was lent to the next chunk read and overwritten under
the copy (CI, issue 42: an OCDBT restore from a bucket differed from the local one in one AdamW
moment; on a busy 2-core machine one restore in three placed a shard with another chunk's bytes)."""

from __future__ import annotations

import gc
import threading

import numpy as np

from hybridckpt.io.aligned_pool import AlignedPool
from hybridckpt.store import held_chunks
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
    before = HeldChunks.used()  # (shared by every array of the process: others may hold some)
    kept_chunk(pool, held)
    _, a = held.take(0, 512)
    _, b = held.take(0, 512)
    a()
    b()
    pool.borrow((4, 256), np.float32)
    assert pool.reuses == 1 and pool.allocations == 1  # given back once, and reused
    assert HeldChunks.used() == before


def test_clear_while_a_piece_is_cut_gives_the_buffer_back_after_it():
    pool, held = AlignedPool(1 << 20), HeldChunks()
    before = HeldChunks.used()
    want = kept_chunk(pool, held)
    piece, done = held.take(0, 100)  # part of the chunk taken; the rest never will be (another host's)
    held.clear()
    assert held.take(0, 100) is None and HeldChunks.used() == before
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


class _OwnerLock:
    """`HeldChunks.budget_lock` that notes (in `self_waits`) an acquire by the thread holding it,
    instead of hanging there: a plain Lock taken again by its holder waits forever."""

    def __init__(self):
        self._lock, self.owner, self.self_waits = threading.Lock(), None, []

    def acquire(self, blocking=True, timeout=-1):
        if self.owner == threading.get_ident():
            self.self_waits.append(threading.get_ident())
            raise RuntimeError("budget_lock taken again by the thread holding it: a deadlock")
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self):
        self.owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def test_an_array_collected_while_the_budget_lock_is_held_does_not_deadlock(monkeypatch):
    """A failed restore leaves its arrays in reference cycles (the error's traceback holds their
    reader frames), so their `HeldChunks` are freed by a garbage collection, which runs in
    whichever thread allocates at that moment: one inside `keep`, holding `budget_lock`. The
    finalizer giving the collected array's bytes back took that lock again there and the thread
    hung forever (the lock is not reentrant). Forced here: the collection runs inside `keep`."""
    gc.collect()  # (arrays of earlier tests collected now, their bytes settled by a keep against the real budget)
    flush = HeldChunks()
    flush.keep(0, np.zeros(1), 1, limit=1 << 40)
    flush.clear()
    lock = _OwnerLock()
    monkeypatch.setattr(HeldChunks, "budget_lock", lock)
    monkeypatch.setattr(HeldChunks, "budget_used", [0])
    monkeypatch.setattr(HeldChunks, "_dropped", [], raising=False)
    gc.disable()
    try:
        dead = HeldChunks()
        assert dead.keep(0, np.zeros(256, np.float32), 256, limit=1 << 20)
        dead.cycle = dead  # (garbage only a collection frees, as a failed restore's arrays are)
        del dead

        class CollectingKept(held_chunks._Kept):
            __slots__ = ()

            def __init__(self, *args):
                gc.collect()  # (the collection an allocation inside `keep` starts, lock held)
                super().__init__(*args)

        monkeypatch.setattr(held_chunks, "_Kept", CollectingKept)
        live = HeldChunks()
        assert live.keep(0, np.zeros(64, np.float32), 64, limit=1 << 20)
    finally:
        gc.enable()
    assert lock.self_waits == []
    assert HeldChunks.used() == 64 * 4  # (the collected array's 1 KiB back in the budget, the live one's kept)
    live.clear()
    assert HeldChunks.used() == 0
