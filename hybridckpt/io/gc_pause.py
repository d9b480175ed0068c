"""`gc_paused`: Python's cyclic garbage collector off for a stretch that builds many objects and
no cycles (back on after, as it was).

Opening a checkpoint of many ranks builds hundreds of thousands of small objects that live on
(a torchtitan DeepSeek V3 source: 267k expert views for its 133,632 per-expert tensors, one row
dict a tensor for `inspect`); each of them counts toward the collector's next pass, and each
full pass walks every object alive. On the 64-rank DeepSeek V3 source those passes were half the
CPU time of splitting the grouped experts and of `inspect`'s summary. Reference counting still
frees everything acyclic at once; what cyclic garbage the stretch makes (a caught exception's
traceback) is collected once the collector is back on.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC off inside the block, restored to what it was after (nesting is fine)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
