"""`gc_paused`: Python's cyclic garbage collector off for a stretch that builds many objects and
no cycles (back on after, as it was); `loading_modules`: the same for a job's first imports of
JAX, Orbax and TensorStore, after which the command line's own process freezes what they made.

Opening a checkpoint of many ranks builds hundreds of thousands of small objects that live on
(a torchtitan DeepSeek V3 source: 267k expert views for its 133,632 per-expert tensors, one row
dict a tensor for `inspect`); each of them counts toward the collector's next pass, and each
full pass walks every object alive. On the 64-rank DeepSeek V3 source those passes were half the
CPU time of splitting the grouped experts and of `inspect`'s summary. Reference counting still
frees everything acyclic at once; what cyclic garbage the stretch makes (a caught exception's
traceback) is collected once the collector is back on.

Loading JAX, Orbax and TensorStore makes a few hundred thousand objects (modules, functions,
classes) that live as long as the process. While they load, the collector's full passes walk all
of them: two passes of 23-59 ms each in a `hybridckpt import` on the 2-core VM (issue 42), in the
job's `start` stage, and each later full pass walks them again. `loading_modules()` pauses the
collector while they load; where the process is the `hybridckpt` command (`freeze_after_loading`,
which `cli.run` calls), it then moves every object alive into the collector's permanent generation
(`gc.freeze`), which its passes never walk: a command's objects live to its exit anyway. A program
that imports the library keeps its collector as it was (paused for the stretch only).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_freeze = False


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


def freeze_after_loading(on: bool = True) -> None:
    """Whether `loading_modules` freezes the objects alive once the modules are loaded: only for
    a process that lives for one command (the CLI's entry point sets it)."""
    global _freeze
    _freeze = bool(on)


@contextlib.contextmanager
def loading_modules() -> Iterator[None]:
    """`gc_paused` around a job's first imports of its heavy modules; after them, with
    `freeze_after_loading` on, `gc.freeze()` (see the module doc)."""
    with gc_paused():
        yield
        if _freeze:  # (before the collector is back on: its first pass would walk them all, ~60 ms)
            gc.freeze()
