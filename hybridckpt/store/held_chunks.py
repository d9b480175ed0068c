"""The chunks a restore read whole for one piece, kept for the pieces other boxes cut from them
(`store.checked.CheckedArray`), within a byte budget every array shares; each kept chunk's buffer
goes back to the pool that lent it (`io.aligned_pool.AlignedPool.borrow`) once its last piece is
cut, or when the array is released.

A buffer goes back only when no thread is still copying out of it: the last piece's `take` can
come before an earlier piece's copy has ended, and a buffer given back then was lent to the next
chunk and overwritten under that copy (shards of a restore with wrong bytes, on a loaded machine,
issue 42's CI). Each `take` is answered with a `done` to call after the copy; the buffer goes back
at the last `done` of a chunk no further piece will take.

An array dropped with chunks still kept (a failed restore: the error's traceback holds its reader
frames in a reference cycle) gives its bytes back to the budget when it is collected; a garbage
collection runs in whichever thread allocates at that moment, possibly one inside `keep` holding
`budget_lock`, so that finalizer takes no lock (it would wait forever on the lock its own thread
holds): it queues the bytes (`_dropped`), and the next `keep` or `used` takes them off."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np

HELD_BYTES = 256 << 20  # chunk bytes all `HeldChunks` keep at most (the default `limit`)


class HeldChunks:
    """Chunks of one array read whole (and checked) for one piece, kept until their other pieces
    are read, within a budget shared by every array (`limit`, HELD_BYTES; past it a later piece is read
    from the file again; what an array holds is given back when it is dropped): a restore onto a
    mesh that cuts every chunk in two then reads each chunk once, not one and a half times."""

    budget_lock = threading.Lock()
    budget_used = [0]
    _dropped: list[int] = []  # bytes of arrays collected since (`_collected`), not yet off budget_used

    def __init__(self):
        self._held: dict[int, _Kept] = {}  # position -> the chunk kept, while pieces of it are left
        self._bytes = [0]  # held by this array (given back by `clear`, or once collected)
        self._lock = threading.Lock()
        weakref.finalize(self, HeldChunks._collected, self._bytes)

    @staticmethod
    def _give_back(cell: list) -> None:
        with HeldChunks.budget_lock:
            HeldChunks.budget_used[0] -= cell[0]
            cell[0] = 0

    @staticmethod
    def _collected(cell: list) -> None:
        """The finalizer: no lock taken (see the module doc); the bytes queued for the next `keep`."""
        n, cell[0] = cell[0], 0
        if n:
            HeldChunks._dropped.append(n)

    @staticmethod
    def _settle() -> None:
        """Take the bytes of collected arrays off the budget (call holding `budget_lock`)."""
        while HeldChunks._dropped:
            HeldChunks.budget_used[0] -= HeldChunks._dropped.pop()

    @staticmethod
    def used() -> int:
        """Chunk bytes all arrays keep now (tests count them)."""
        with HeldChunks.budget_lock:
            HeldChunks._settle()
            return HeldChunks.budget_used[0]

    def keep(self, pos: int, data: np.ndarray, left: int, give=None, limit: int = HELD_BYTES) -> bool:
        """Keep `data` (chunk `pos`) for pieces of `left` elements more; False where it is not
        kept (nothing left, kept already, past the budget: `limit` bytes kept by all). `give`:
        gives its buffer back to the pool that lent it, called once no piece is left to take and
        no piece taken is being cut (the last `done` of `take`), or by `clear`."""
        if left <= 0:
            return False
        with self._lock, HeldChunks.budget_lock:
            HeldChunks._settle()
            if pos in self._held or HeldChunks.budget_used[0] + data.nbytes > limit:
                return False
            HeldChunks.budget_used[0] += data.nbytes
            self._held[pos] = _Kept(data, left, give)
            self._bytes[0] += data.nbytes
            return True

    def clear(self) -> None:
        """Drop every chunk kept, giving their bytes back to the budget; each buffer goes back
        now, or when the last piece being cut from it is done."""
        with self._lock:
            held, self._held = self._held, {}
            HeldChunks._give_back(self._bytes)
            ready = [k for k in held.values() if k.close()]
        for kept in ready:
            kept.give()

    def take(self, pos: int, elements: int) -> tuple[np.ndarray, Callable[[], None]] | None:
        """(chunk `pos`, and the callable to call once the piece of `elements` is cut from it:
        it gives the buffer back after the chunk's last piece), or None if not kept."""
        with self._lock:
            kept = self._held.get(pos)
            if kept is None:
                return None
            kept.left -= elements
            kept.cutting += 1
            if kept.left <= 0:  # (no piece will take it again: out of the budget now)
                del self._held[pos]
                self._bytes[0] -= kept.data.nbytes
                with HeldChunks.budget_lock:
                    HeldChunks.budget_used[0] -= kept.data.nbytes
        return kept.data, lambda: self._done(kept)

    def _done(self, kept: _Kept) -> None:
        with self._lock:
            kept.cutting -= 1
            ready = kept.left <= 0 and kept.close()
        if ready:
            kept.give()


class _Kept:
    """One kept chunk: its buffer, the elements its pieces still to take hold, the takes whose
    cut has not ended, and the callable giving its buffer back (None: a fresh buffer)."""

    __slots__ = ("data", "left", "cutting", "_give", "_closed")

    def __init__(self, data: np.ndarray, left: int, give):
        self.data, self.left, self.cutting, self._give, self._closed = data, left, 0, give, False

    def close(self) -> bool:
        """Mark it dropped (no more takes); True once, when its buffer may go back now (no cut
        under way). Called under the owner's lock."""
        self.left = 0
        if self._closed or self.cutting:
            return False
        self._closed = True
        return True

    def give(self) -> None:
        if self._give is not None:
            self._give()
