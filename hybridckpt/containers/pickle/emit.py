"""Pickles WRITTEN without the classes they name: torch's `.metadata` and `torch.save` records.

A checkpoint for torch (or Megatron) must pickle objects of classes we never import
(`torch.distributed.checkpoint.metadata.Metadata`, `torch.Size`, `torch.float32`,
`argparse.Namespace`). They are described here by three inert values, and `dumps` writes the
opcodes CPython's own pickler writes for the real objects (Lib/pickle.py `_Pickler.save`):

- `Global(module, name)`: a class or constant named by reference (`torch.float32`,
  `torch.FloatStorage`): GLOBAL (protocol 2) or two strings and STACK_GLOBAL (protocol 4).
- `Obj(cls, state)`: what `object.__reduce_ex__` gives for a plain or dataclass instance:
  `cls` (a Global), an empty args tuple, NEWOBJ, then `state` (its `__dict__`, or what its
  `__getstate__` returns) and BUILD.
- `Reduce(func, args)`: `func(*args)` (REDUCE): `torch.Size((2, 3))`, an Enum member
  `_MEM_FORMAT_ENCODING(0)`, `collections.OrderedDict()`.
- `PersistentId(value)`: torch.save's storage reference, `value` then BINPERSID.

Plain values: None, bool, int, float, str, bytes, tuple, list, dict. Memoization follows
CPython's (every container and string once, by identity: one Python object used twice is
written once and fetched with BINGET/`h`); protocol 4 is framed in frames of 64 KiB as
CPython frames it. The result loads with `pickle.loads` where the named classes exist (torch
installed), and with the restricted unpickler (`machine`) everywhere.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

FRAME_TARGET = 64 * 1024  # CPython's _Framer._FRAME_SIZE_TARGET
FRAME_MIN = 4
BATCH = 1000  # items per APPENDS / SETITEMS


@dataclass(frozen=True, eq=False)
class Global:
    """`module.name`, pickled by reference (a class, a function, a module constant)."""

    module: str
    name: str


@dataclass(frozen=True, eq=False)
class Obj:
    """An instance of `cls` rebuilt by NEWOBJ (no args) and BUILD(`state`); `state` None: no BUILD."""

    cls: Global
    state: Any = None


@dataclass(frozen=True, eq=False)
class Reduce:
    """`func(*args)`, then BUILD(`state`) when `state` is not None."""

    func: Global
    args: tuple
    state: Any = None


@dataclass(frozen=True, eq=False)
class PersistentId:
    """A persistent reference (torch.save: `('storage', StorageClass, key, location, numel)`)."""

    value: Any


def dumps(obj: Any, protocol: int = 4) -> bytes:
    """The pickle of `obj` (protocol 2 or 4), as CPython writes it (see the module doc)."""
    if protocol not in (2, 4):
        raise ValueError(
            f"protocol {protocol}: only 2 (torch.save) and 4 (pickle.dump) are written"
        )
    w = _Writer(protocol)
    w.save(obj)
    w.op(b".")
    return w.finish()


class _Writer:
    def __init__(self, protocol: int):
        self.proto = protocol
        self.out = io.BytesIO()
        self.out.write(b"\x80" + bytes([protocol]))
        self.frame = io.BytesIO() if protocol >= 4 else None
        self.memo: dict[int, int] = {}
        self.keep: list = []  # memoized objects stay alive: their ids stay theirs

    # -- output -----------------------------------------------------------------------------
    def op(self, data: bytes) -> None:
        (self.frame or self.out).write(data)

    def commit(self, force: bool = False) -> None:
        if self.frame is None:
            return
        if self.frame.tell() >= FRAME_TARGET or (force and self.frame.tell()):
            data = self.frame.getvalue()
            if len(data) >= FRAME_MIN:
                self.out.write(b"\x95" + struct.pack("<Q", len(data)))
            self.out.write(data)
            self.frame = io.BytesIO()

    def finish(self) -> bytes:
        self.commit(force=True)
        return self.out.getvalue()

    # -- memo -------------------------------------------------------------------------------
    def memoize(self, obj: Any) -> None:
        idx = len(self.memo)
        self.memo[id(obj)] = idx
        self.keep.append(obj)
        if self.proto >= 4:
            self.op(b"\x94")
        elif idx < 256:
            self.op(b"q" + bytes([idx]))
        else:
            self.op(b"r" + struct.pack("<I", idx))

    def get(self, obj: Any) -> bool:
        idx = self.memo.get(id(obj))
        if idx is None:
            return False
        self.op(b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx))
        return True

    # -- values -----------------------------------------------------------------------------
    def save(self, obj: Any) -> None:
        self.commit()  # as CPython: a full frame is committed before the next object
        self._save(obj)

    def _save(self, obj: Any) -> None:
        if obj is None:
            self.op(b"N")
        elif obj is True or obj is False:
            self.op(b"\x88" if obj else b"\x89")
        elif isinstance(obj, int):
            self._int(obj)
        elif isinstance(obj, float):
            self.op(b"G" + struct.pack(">d", obj))
        elif self.get(obj):
            return
        elif isinstance(obj, str):
            self._str(obj)
        elif isinstance(obj, bytes):
            self._bytes(obj)
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, list):
            self._list(obj)
        elif isinstance(obj, dict):
            self._dict(obj)
        elif isinstance(obj, Global):
            self._global(obj)
        elif isinstance(obj, Obj):
            self.save(obj.cls)
            self.op(b")\x81")  # EMPTY_TUPLE, NEWOBJ
            self.memoize(obj)
            self._build(obj.state)
        elif isinstance(obj, Reduce):
            self.save(obj.func)
            self.save(tuple(obj.args))
            self.op(b"R")
            self.memoize(obj)
            self._build(obj.state)
        elif isinstance(obj, PersistentId):
            self.save(obj.value)
            self.op(b"Q")
        else:
            raise TypeError(f"emit.dumps: cannot write a {type(obj).__name__}")

    def _build(self, state: Any) -> None:
        if state is not None:
            self.save(state)
            self.op(b"b")

    def _int(self, v: int) -> None:
        if 0 <= v < 256:
            self.op(b"K" + bytes([v]))
        elif 0 <= v < 65536:
            self.op(b"M" + struct.pack("<H", v))
        elif -(2**31) <= v < 2**31:
            self.op(b"J" + struct.pack("<i", v))
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.op(b"\x8a" + bytes([len(raw)]) + raw)

    def _str(self, s: str) -> None:
        raw = s.encode("utf-8", "surrogatepass")
        if self.proto >= 4 and len(raw) < 256:
            self.op(b"\x8c" + bytes([len(raw)]) + raw)
        elif self.frame is not None and len(raw) >= FRAME_TARGET:  # CPython: outside any frame
            self.commit(force=True)
            self.out.write(b"X" + struct.pack("<I", len(raw)) + raw)
        else:
            self.op(b"X" + struct.pack("<I", len(raw)) + raw)
        self.memoize(s)

    def _bytes(self, b: bytes) -> None:
        if self.proto < 3:
            raise TypeError("emit.dumps: bytes need protocol 3 or later")
        self.op((b"C" + bytes([len(b)]) if len(b) < 256 else b"B" + struct.pack("<I", len(b))) + b)
        self.memoize(b)

    def _tuple(self, t: tuple) -> None:
        if not t:
            self.op(b")")
            return
        if len(t) <= 3:
            for x in t:
                self.save(x)
            self.op(b"\x85\x86\x87"[len(t) - 1 : len(t)])
        else:
            self.op(b"(")
            for x in t:
                self.save(x)
            self.op(b"t")
        self.memoize(t)

    def _list(self, items: list) -> None:
        self.op(b"]")
        self.memoize(items)
        if len(items) == 1:
            self.save(items[0])
            self.op(b"a")
            return
        for start in range(0, len(items), BATCH):  # C's batch_list_exact
            self.op(b"(")
            for x in items[start : start + BATCH]:
                self.save(x)
            self.op(b"e")

    def _dict(self, d: dict) -> None:
        self.op(b"}")
        self.memoize(d)
        pairs = list(d.items())
        if len(pairs) == 1:
            self.save(pairs[0][0])
            self.save(pairs[0][1])
            self.op(b"s")
            return
        start = 0
        while pairs:  # C's batch_dict_exact: a full last batch is followed by an empty one
            self.op(b"(")
            batch = pairs[start : start + BATCH]
            for k, v in batch:
                self.save(k)
                self.save(v)
            self.op(b"u")
            start += BATCH
            if len(batch) < BATCH:
                break

    def _global(self, g: Global) -> None:
        if self.proto >= 4:
            self.save(g.module)
            self.save(g.name)
            self.op(b"\x93")
        else:
            self.op(b"c" + g.module.encode() + b"\n" + g.name.encode() + b"\n")
        self.memoize(g)
