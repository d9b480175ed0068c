"""The chunks a restore read whole for one piece, kept for the pieces other boxes cut from them
(`store.checked.CheckedArray`), within a byte budget every array shares; each kept chunk's buffer
goes back to the pool that lent it (`io.aligned_pool.AlignedPool.borrow`) when its last piece is
cut, or when the array is released."""

from __future__ import annotations

import threading
import weakref

import numpy as np

HELD_BYTES = 256 << 20  # chunk bytes all `HeldChunks` keep at most (the default `limit`)


class HeldChunks:
    """Chunks of one array read whole (and checked) for one piece, kept until their other pieces
    are read, within a budget shared by every array (`limit`, HELD_BYTES; past it a later piece is read
    from the file again; what an array holds is given back when it is dropped): a restore onto a
    mesh that cuts every chunk in two then reads each chunk once, not one and a half times."""

    budget_lock = threading.Lock()
    budget_used = [0]

    def __init__(self):
        self._held: dict[int, list] = {}  # position -> [data, elements left, give back or None]
        self._bytes = [0]  # held by this array (given back by the finalizer)
        self._lock = threading.Lock()
        weakref.finalize(self, HeldChunks._give_back, self._bytes)

    @staticmethod
    def _give_back(cell: list) -> None:
        with HeldChunks.budget_lock:
            HeldChunks.budget_used[0] -= cell[0]
            cell[0] = 0

    def keep(self, pos: int, data: np.ndarray, left: int, give=None, limit: int = HELD_BYTES) -> bool:
        """Keep `data` (chunk `pos`) for pieces of `left` elements more; False where it is not
        kept (nothing left, kept already, past the budget: `limit` bytes kept by all). `give`:
        gives its buffer back to the pool that lent it, called by `take` for the last piece or
        by `clear`."""
        if left <= 0:
            return False
        with self._lock, HeldChunks.budget_lock:
            if pos in self._held or HeldChunks.budget_used[0] + data.nbytes > limit:
                return False
            HeldChunks.budget_used[0] += data.nbytes
            self._held[pos] = [data, left, give]
            self._bytes[0] += data.nbytes
            return True

    def clear(self) -> None:
        """Drop every chunk kept, giving their bytes back to the budget and their buffers back."""
        with self._lock:
            held, self._held = self._held, {}
            HeldChunks._give_back(self._bytes)
        for _, _, give in held.values():
            if give is not None:
                give()

    def take(self, pos: int, elements: int) -> tuple[np.ndarray, object] | None:
        """(chunk `pos`, for a piece of `elements`; and for its last piece the callable that gives
        its buffer back, to call once the piece is cut: None before), or None if not kept."""
        with self._lock:
            entry = self._held.get(pos)
            if entry is None:
                return None
            entry[1] -= elements
            if entry[1] > 0:
                return entry[0], None
            del self._held[pos]
            self._bytes[0] -= entry[0].nbytes
            with HeldChunks.budget_lock:
                HeldChunks.budget_used[0] -= entry[0].nbytes
            return entry[0], entry[2]
