"""The specialised reader of DCP `.metadata` pickles: millions of chunks, no object per chunk.

`pickle.dump(metadata)` (torch's `FileSystemWriter.finish`, protocol 4) writes each chunk as
`ChunkStorageMetadata(offsets=torch.Size(...), sizes=torch.Size(...))` and each storage entry
as `MetadataIndex(fqn, index, offset) -> _StorageInfo(relative_path, offset, length)`: the same
few dozen opcodes over and over, the classes and field names fetched from the memo. The general
machine (`containers.pickle.machine`: an opcode walk for its guards, then the C unpickler with
stub classes) builds ~15 objects per chunk; at 873k chunks that is 3x torch's own time and as
much memory.

This reader runs the same pickle as a small stack machine over a strict subset of opcodes
(strings, ints, floats, None/bools, tuples, lists, dicts, MARK, MEMOIZE, BINGET,
STACK_GLOBAL, NEWOBJ, REDUCE, BUILD, STOP), resolving every global through the same allow-list
policy and calling the same policy objects (`DCP_POLICY`: stub classes, `torch.Size`, ...) the
general machine calls; NEWOBJ only on stub classes, REDUCE only on stubs and the policy's frozen
functions, BUILD only on stubs. Where a chunk or a storage entry starts and the memo already holds
its class and field names, one compiled pattern of those exact bytes (`containers.dcp_records`)
matches the whole record and its numbers go straight into `RawTables` columns (megatron's
save plans' write items: `containers.dcp_plans`, matched and counted, never read; each tensor's
`TensorStorageMetadata` head: `containers.dcp_heads`, done as the loop would) (a placeholder on the stack
until APPENDS / SETITEMS put them in order); anything else runs opcode by opcode. Entries a
matched record memoizes are not kept (only its strings): a later fetch of one, and every opcode,
shape or value outside the subset, raises `Fallback`, and the caller reads the file with the
general machine instead (so every error message, and every accepted file's meaning, is the
general machine's; `tests/io/test_dcp_fast.py` shows both agree).

Frames (protocol 4: `FRAME n` then n bytes of opcodes) are walked first and removed; each frame
must begin where an opcode of the stream begins, as the C unpickler reads them (else Fallback).
"""

from __future__ import annotations

import struct

from hybridckpt.containers.dcp_heads import tensor_head
from hybridckpt.containers.dcp_plans import _ITEM, item_entry, item_pattern, plan_items
from hybridckpt.containers.dcp_records import _MISSING, _VALUE, Fallback, Records, _Row, deframe
from hybridckpt.containers.dcp_stubs import DCP_POLICY, chunk_row, extract, kind, storage_entry
from hybridckpt.containers.dcp_tables import RawTables, numbers_budget
from hybridckpt.containers.pickle.allow import Contextual, Frozen, Stub, stub_class
from hybridckpt.errors import HybridCkptError

__all__ = ["Fallback", "deframe", "read"]


# -- the machine --------------------------------------------------------------------------------


class _Machine(Records):
    """The opcode loop over `Records`: every opcode outside a matched record, one at a time."""

    def append_rows(self, lst: list, items: list) -> None:
        raw = self.raw
        reg = self.lists.get(id(lst))
        if reg is None:
            if lst:
                raise Fallback
            reg = self.lists[id(lst)] = [lst, len(raw.c_nd), 0]
        if reg[1] + reg[2] != len(raw.c_nd):
            raise Fallback  # rows of this list would not be consecutive
        for x in items:
            if type(x) is _Row:
                if x is _VALUE or len(x.data) != 2:
                    raise Fallback
                raw.add_chunk(*x.data)
            else:
                self.convert(x)
                try:
                    chunk_row(raw, x, self.path)
                except HybridCkptError:
                    raise Fallback from None
        reg[2] = len(raw.c_nd) - reg[1]

    def set_entries(self, d: dict, pairs: list) -> None:
        raw = self.raw
        if id(d) not in self.storage:
            if d or self.storage:
                raise Fallback  # one storage dict, fresh
            self.storage[id(d)] = d
        for k, v in pairs:
            if type(k) is _Row:
                if v is not _VALUE or k is _VALUE or len(k.data) != 5:
                    raise Fallback
                fqn, offs, path, off, length = k.data
                raw.s_fqn.append(fqn)
                if offs is None:
                    raw.s_nd.append(-1)
                else:
                    raw.s_nd.append(len(offs))
                    raw.s_coords.extend(offs)
                raw.s_path.append(path)
                raw.s_off.append(off)
                raw.s_len.append(length)
            else:
                if type(v) is _Row:
                    raise Fallback
                self.convert(k)
                self.convert(v)
                try:
                    storage_entry(raw, k, v, self.path)
                except HybridCkptError:
                    raise Fallback from None

    def fetch_more(self, i: int):
        v = item_entry(self, i)
        if v is _MISSING:
            raise Fallback  # an entry inside a matched record, or none
        return v

    # -- the loop -------------------------------------------------------------------------------
    def run(self):
        buf, stack, marks = self.buf, self.stack, self.marks
        end = len(buf)
        pos = 0
        frames, nf = self.frames, len(self.frames)
        ops = 0
        try:
            while True:
                ops += 1
                if self.fi < nf and frames[self.fi] <= pos:
                    if frames[self.fi] < pos:
                        raise Fallback  # a frame starts inside an opcode
                    self.fi += 1
                if pos >= end:
                    raise Fallback
                op = buf[pos]
                pos += 1
                if op == 0x94:  # MEMOIZE
                    if not stack:
                        raise Fallback
                    self.memoize(stack[-1])
                elif op == 0x28:  # MARK
                    marks.append(len(stack))
                    nxt = buf[pos : pos + 1]
                    if nxt == b"h" or nxt == b"j":  # a batch of list items or dict entries
                        pos = self.chunks(pos)
                        pos = self.entries(pos)
                        if self.item_pattern is not None:
                            pos = plan_items(self, pos)
                elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                    if op == 0x68:
                        i, pos = buf[pos], pos + 1
                    else:
                        i, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
                    stack.append(self.fetch(i))
                elif op == 0x8C or op == 0x58 or op == 0x8D:  # SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                    w = 1 if op == 0x8C else 4 if op == 0x58 else 8
                    n = int.from_bytes(buf[pos : pos + w], "little")
                    stack.append(self._text(pos + w, n))
                    pos += w + n
                    if buf[pos : pos + 1] == b"\x94":  # a tensor's key: its head may follow
                        pos = tensor_head(self, pos)
                elif op == 0x4B:  # BININT1
                    stack.append(buf[pos])
                    pos += 1
                elif op == 0x4D:  # BININT2
                    stack.append(buf[pos] | buf[pos + 1] << 8)
                    pos += 2
                elif op == 0x4A:  # BININT
                    stack.append(int.from_bytes(buf[pos : pos + 4], "little", signed=True))
                    pos += 4
                elif op == 0x8A:  # LONG1
                    n = buf[pos]
                    stack.append(int.from_bytes(buf[pos + 1 : pos + 1 + n], "little", signed=True))
                    pos += 1 + n
                elif op == 0x47:  # BINFLOAT
                    stack.append(struct.unpack_from(">d", buf, pos)[0])
                    pos += 8
                elif op == 0x4E:  # NONE
                    stack.append(None)
                elif op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
                    stack.append(op == 0x88)
                elif op == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
                    n = op - 0x84
                    if len(stack) < n or (marks and marks[-1] > len(stack) - n):
                        raise Fallback
                    items = stack[-n:]
                    del stack[-n:]
                    stack.append(tuple(self._clean(items)))
                elif op == 0x74:  # TUPLE
                    stack.append(tuple(self._clean(self._pop_mark())))
                elif op == 0x5D:  # EMPTY_LIST
                    stack.append([])
                elif op == 0x7D:  # EMPTY_DICT
                    stack.append({})
                elif op == 0x61:  # APPEND
                    self._append()
                elif op == 0x65:  # APPENDS
                    self._appends()
                elif op == 0x73:  # SETITEM
                    if len(stack) < 3 or (marks and marks[-1] > len(stack) - 2):
                        raise Fallback
                    k, v = stack[-2], stack[-1]
                    del stack[-2:]
                    self._setitems(stack[-1], [(k, v)])
                elif op == 0x75:  # SETITEMS
                    items = self._pop_mark()
                    if len(items) % 2 or not stack:
                        raise Fallback
                    self._setitems(stack[-1], list(zip(items[::2], items[1::2], strict=True)))
                elif op == 0x93:  # STACK_GLOBAL
                    if len(stack) < 2:
                        raise Fallback
                    name, module = stack.pop(), stack.pop()
                    stack.append(self._global(module, name))
                elif op == 0x81:  # NEWOBJ
                    if len(stack) < 2:
                        raise Fallback
                    args, cls = stack.pop(), stack.pop()
                    if not (isinstance(cls, type) and issubclass(cls, Stub)) or type(args) is not tuple:
                        raise Fallback
                    stack.append(cls.__new__(cls, *self._clean(args)))
                elif op == 0x52:  # REDUCE
                    if len(stack) < 2:
                        raise Fallback
                    args, fn = stack.pop(), stack.pop()
                    if type(args) is not tuple or not (
                        isinstance(fn, Frozen) or (isinstance(fn, type) and issubclass(fn, Stub))
                    ):
                        raise Fallback
                    stack.append(self._call(fn, args))
                elif op == 0x62:  # BUILD
                    if len(stack) < 2:
                        raise Fallback
                    state = stack.pop()
                    inst = stack[-1]
                    if not isinstance(inst, Stub):
                        raise Fallback
                    if id(inst) in self.converted or type(state) is _Row:
                        raise Fallback
                    self._clean(state if isinstance(state, tuple) else (state,))
                    inst.__setstate__(state)
                    nxt = buf[pos : pos + 1]
                    if (nxt == b"h" and buf.startswith(b")\x81", pos + 2)) or (
                        nxt == b"j" and buf.startswith(b")\x81", pos + 5)
                    ):  # an object follows: the records after one the loop read (else it would
                        pos = self.chunks(pos)  # read the rest of its batch, up to 1000, too)
                        pos = self.entries(pos)
                        if self.item_pattern is not None:
                            pos = plan_items(self, pos)
                elif op == 0x2E:  # STOP
                    if len(stack) != 1 or marks or pos != end:
                        raise Fallback
                    if self.fi != nf:
                        raise Fallback
                    return stack[0]
                else:
                    raise Fallback
        finally:
            self.ops += ops  # opcodes read one at a time (a measure of the slow path's work)

    # -- helpers --------------------------------------------------------------------------------
    def _text(self, at: int, n: int) -> str:
        if at + n > len(self.buf):
            raise Fallback
        try:
            return self.buf[at : at + n].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise Fallback from None

    def _pop_mark(self) -> list:
        if not self.marks:
            raise Fallback
        k = self.marks.pop()
        items = self.stack[k:]
        del self.stack[k:]
        return items

    @staticmethod
    def _clean(items):
        for x in items:
            if type(x) is _Row:
                raise Fallback
        return items

    def _append(self) -> None:
        stack, marks = self.stack, self.marks
        if len(stack) < 2 or (marks and marks[-1] > len(stack) - 1):
            raise Fallback
        x = stack.pop()
        self._into(stack[-1], [x])

    def _appends(self) -> None:
        items = self._pop_mark()
        if not self.stack:
            raise Fallback
        self._into(self.stack[-1], items)

    def _into(self, lst, items: list) -> None:
        if type(lst) is not list:
            raise Fallback
        if any(x is _ITEM for x in items):  # matched write items: only into a plan's list, nothing else of ours
            if id(lst) in self.lists or any(
                (type(x) is _Row and x is not _ITEM) or type(x) is self.chunk_class for x in items
            ):
                raise Fallback
            self.plan_lists[id(lst)] = lst
            lst.extend(items)
            return
        if any(type(x) is _Row or (isinstance(x, Stub) and type(x) is self.chunk_class) for x in items):
            self.append_rows(lst, items)
        elif id(lst) in self.lists:
            raise Fallback
        else:
            lst.extend(items)

    def _setitems(self, d, pairs: list) -> None:
        if type(d) is not dict:
            raise Fallback
        if any(type(k) is _Row or kind(k) == "MetadataIndex" for k, _ in pairs):
            self.set_entries(d, pairs)
        elif id(d) in self.storage:
            raise Fallback
        else:
            for k, v in pairs:
                if type(k) is _Row or type(v) is _Row:
                    raise Fallback
                try:
                    d[k] = v
                except TypeError:
                    raise Fallback from None

    def _global(self, module, name):
        if type(module) is not str or type(name) is not str:
            raise Fallback
        obj = DCP_POLICY.allowed.get((module, name), _MISSING)
        if obj is not _MISSING:
            if isinstance(obj, Contextual):
                raise Fallback
            return obj
        if DCP_POLICY.is_stubbed(f"{module}.{name}"):
            return stub_class(module, name)
        raise Fallback  # the general machine refuses it, naming it

    def _call(self, fn, args):
        self._clean(args)
        try:
            return fn(*args)
        except HybridCkptError:
            raise Fallback from None
        except (TypeError, ValueError, OverflowError):
            raise Fallback from None


_ITEM_PATTERN = item_pattern()


def read(data: bytearray, path: str) -> tuple[RawTables, tuple]:
    """`RawTables` of one `.metadata` file's bytes (changed in place) and `extract`'s other
    results (byte item fqns, planner_data, version, written_to); Fallback when the file is not
    the shape this reader knows."""
    budget = numbers_budget(len(data))
    frames = deframe(data)
    buf = bytes(data)  # matches and their groups as bytes (hashable)
    data.clear()
    raw = RawTables(budget=budget)
    m = _Machine(buf, frames, path, raw)
    if b"WriteItem" in buf:
        m.item_pattern = _ITEM_PATTERN
    try:
        md = m.run()
    except Fallback:
        raise
    except Exception:  # noqa: BLE001 - any surprise (a bad name, a short read): the general machine decides
        raise Fallback from None
    storage = vars(md).get("storage_data") if isinstance(md, Stub) else None
    if type(storage) is not dict or (m.storage and id(storage) not in m.storage):
        raise Fallback
    if storage and id(storage) not in m.storage:
        raise Fallback
    used: dict[int, tuple[int, int]] = {}

    def rows_of(chunks):
        if type(chunks) is not list:
            raise Fallback
        reg = m.lists.get(id(chunks))
        if reg is None:
            if chunks:
                raise Fallback
            return (len(raw.c_nd), 0)
        if id(chunks) in used:
            raise Fallback  # one chunk list in two tensors
        used[id(chunks)] = (reg[1], reg[2])
        return reg[1], reg[2]

    try:
        rest = extract(md, raw, path, rows_of=rows_of, storage_done=True)
    except HybridCkptError:
        raise Fallback from None
    except Exception:  # noqa: BLE001 - a matched write item where a reader looks: the general machine decides
        if m.plan_lists:
            raise Fallback from None
        raise
    if m.plan_lists:
        _items_only_in_plans(md, m.plan_lists, rest)
    if sum(c for _, c in used.values()) != len(raw.c_nd) or len(used) != len(m.lists):
        raise Fallback  # chunk rows no tensor holds
    return raw, rest


def _items_only_in_plans(md, plan_lists: dict, rest: tuple) -> None:
    """Fallback unless every list that matched write items went into is one plan's `items` in
    `md.all_local_plans`, and no matched item reached what `extract` returned."""
    plans = vars(md).get("all_local_plans")
    held = {id(vars(p).get("items")) for p in plans if isinstance(p, Stub)} if type(plans) is list else set()
    if any(i not in held for i in plan_lists):
        raise Fallback
    _, planner, version, written = rest
    if any(x is _ITEM for v in planner.values() for x in v):
        raise Fallback
    if not (version is None or type(version) is str) or not (written is None or type(written) is str):
        raise Fallback
