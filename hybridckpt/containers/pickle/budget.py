"""The expansion budget of an unpickled object: objects and bytes counted over shared references.

A pickle's memo lets one object be referenced any number of times at two bytes a reference
(BINGET): a list of ten references to a list of ten references to ... is a few hundred bytes
that reads as a tree of 10^9 leaves ("billion laughs"). The unpickler builds only the shared
graph (cheap), but every reader that walks, copies, prints or converts the result walks the
tree: `scheduler.pt` `last_lr`, Megatron's `common.pt` `opt_param_scheduler`, Paddle's `.pdopt`
`LR_Scheduler` and DeepSpeed universal `param_shapes` made of such lists ran 60-90 s to 3-7 GB.

`expanded_size` counts what a full walk of the result would meet, each shared object counted
again at every reference (so a memo get of a container counts its whole size again), in one pass
over the distinct objects (their counts kept per object id: linear in the pickle, never in the
expansion); `check_expansion` refuses, in one line naming the file, a result whose count runs
past `budget_for(pickle bytes)`: a fixed floor far above what real checkpoint pickles expand to
(they share only a few small tuples and strings: an expansion of ~1x the pickle's own objects),
plus an allowance per byte of pickle, so a reader's work stays bounded by the bytes it is given.

What is counted: one object per value; the length of every str / bytes / bytearray and the
`nbytes` of every numpy array as bytes; the items of lists, tuples, sets and dicts (keys and
values), the attributes of namespaces and the recorded state of `Stub`s. Anything else (tensor
records, dtypes, tokens) is one object. A reference back into an object being counted (a cycle)
counts once.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass

import numpy as np

from hybridckpt.containers.pickle.allow import Stub
from hybridckpt.errors import FormatError

BUDGET_FLOOR_OBJECTS = 1 << 22  # objects: allowed whatever the pickle's size (4M; ~0.5 GB at most walked)
BUDGET_FLOOR_BYTES = 256 << 20  # bytes of strings / arrays, counted at every reference
OBJECTS_PER_PICKLE_BYTE = 4  # allowance on top of the floor: a pickle spends >= 1 byte per object
BYTES_PER_PICKLE_BYTE = 16


@dataclass(frozen=True)
class Budget:
    """Most objects and bytes (strings, bytes, arrays) a pickle of some size may expand to."""

    objects: int
    bytes: int


def budget_for(pickle_bytes: int) -> Budget:
    """The budget of a pickle of `pickle_bytes` bytes: the floor plus a per-byte allowance."""
    return Budget(
        BUDGET_FLOOR_OBJECTS + OBJECTS_PER_PICKLE_BYTE * pickle_bytes,
        BUDGET_FLOOR_BYTES + BYTES_PER_PICKLE_BYTE * pickle_bytes,
    )


_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None))
_SEQUENCES = (list, tuple, set, frozenset)
_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)


def _own(obj) -> tuple[int, int, object]:
    """(objects, bytes, children) of `obj` itself: children an iterable or None."""
    if isinstance(obj, (str, bytes, bytearray)):
        return 1, len(obj), None
    if isinstance(obj, _ATOMS):
        return 1, 0, None
    if isinstance(obj, _SEQUENCES):
        return 1, 0, obj
    if isinstance(obj, dict):
        return 1, 0, _dict_children(obj)
    if isinstance(obj, np.ndarray):
        return 1, int(obj.nbytes), None
    if isinstance(obj, Stub):
        d = vars(obj)
        if "stub_state" in d:  # the dict state's entries are also attributes: count them once
            kids = [v for k, v in d.items() if k.startswith("stub_")]
        else:
            kids = list(d.values())
        return 1, 0, kids
    if isinstance(obj, _NAMESPACES):
        return 1, 0, list(vars(obj).values())
    return 1, 0, None


def _dict_children(d: dict) -> list:
    out = []
    for k, v in d.items():
        out.append(k)
        out.append(v)
    return out


def expanded_size(root, totals: dict | None = None) -> tuple[int, int]:
    """(objects, bytes) a full walk of `root` meets, shared objects counted at every reference.

    Iterative (no recursion on nesting); each distinct container is expanded once and its total
    remembered by id (ids stay valid: `root` keeps every object it reaches alive, and nothing
    changes it during the walk), so the cost is linear in the distinct objects and references.
    """
    totals = {} if totals is None else totals  # id -> (objects, bytes), shared between calls
    objects = 0
    nbytes = 0
    # frames: [obj, iterator over children, objects so far, bytes so far]
    o, b, kids = _own(root)
    if kids is None:
        return o, b
    if id(root) in totals:
        return totals[id(root)]
    stack = [[root, iter(kids), o, b]]
    totals[id(root)] = (1, 0)  # a cycle back to an object being counted counts once
    while stack:
        frame = stack[-1]
        for child in frame[1]:
            if isinstance(child, _ATOMS):
                frame[2] += 1
                if isinstance(child, (str, bytes, bytearray)):
                    frame[3] += len(child)
                continue
            known = totals.get(id(child))
            if known is not None:
                frame[2] += known[0]
                frame[3] += known[1]
                continue
            o, b, kids = _own(child)
            if kids is None:
                frame[2] += o
                frame[3] += b
                continue
            totals[id(child)] = (1, 0)
            stack.append([child, iter(kids), o, b])
            break
        else:
            stack.pop()
            totals[id(frame[0])] = (frame[2], frame[3])
            if stack:
                stack[-1][2] += frame[2]
                stack[-1][3] += frame[3]
            else:
                objects, nbytes = frame[2], frame[3]
    return objects, nbytes


def check_expansion(obj, pickle_bytes: int, *, what: str, shared=((-1, 1),), memo=None) -> None:
    """Refuse `obj` (unpickled from `pickle_bytes` bytes of `what`) when it expands past its budget.

    `shared` (`opcodes.PickleScan.shared`): the memo slots fetched and how often, `memo` the
    unpickler's memo: the result is then counted as what those fetches add (each fetch of a slot
    adds the slot's whole expansion; the objects reached without a fetch are at most those the
    pickle built, fewer than its bytes), walking only the fetched objects' subgraphs (a DCP
    `.metadata` of 10^6 chunks fetches a few hundred small objects). `((-1, n),)` (a DUP, or no
    walk by the caller): the whole result is counted.
    """
    budget = budget_for(pickle_bytes)
    if memo is None or any(index < 0 for index, _ in shared):
        objects, nbytes = expanded_size(obj)
    else:
        slots = memo.copy()
        totals: dict = {}
        objects = nbytes = 0
        for index, fetches in shared:
            if index in slots:
                o, b = expanded_size(slots[index], totals)
                objects += fetches * o
                nbytes += fetches * b
    if objects > budget.objects or nbytes > budget.bytes:
        raise FormatError(
            f"{what}: pickle of {pickle_bytes} bytes expands to at least {objects} objects and {nbytes} "
            f"bytes of data through shared (memo) references, past the budget of "
            f"{budget.objects} objects and {budget.bytes} bytes; refused as a resource bomb"
        )
