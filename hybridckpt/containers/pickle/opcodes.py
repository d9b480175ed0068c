"""The one pickle opcode walk: a pass over a pickle's opcodes that runs nothing.

Every pickle is walked before it is unpickled, by this module only: the restricted machine
refuses denial-of-service input with it (`check_pickle`), the legacy torch.save reader finds
where each of its back-to-back pickles ends, and Paddle's lazy reader finds the large array
payloads it leaves in the file (`scan_pickle(..., payload_min_bytes=)`).

Opcodes (CPython Lib/pickletools.py `opcodes`): one byte, then an argument of one of three forms
- fixed: `n` bytes (BININT 4, LONG_BINPUT 4, FRAME 8, ...);
- counted: a little-endian length of 1, 4 or 8 bytes, then that many bytes (SHORT_BINBYTES,
  BINUNICODE, BINBYTES8, LONG4, ...); the 4-byte counts of BINSTRING and LONG4 are signed;
- lines: one or two newline-terminated lines (protocol 0 text: INT, PUT, GLOBAL
  `module\\nname\\n`).
STOP (`.`) ends a pickle. FRAME (protocol 4, an 8-byte length) only announces how many bytes
of opcodes follow: a read-ahead hint.

Denial-of-service guards (CPython allocates the claimed size before reading it, and grows its
memo table to the index it is given):
- every length-prefixed argument (BINBYTES, BINUNICODE, BINBYTES8, LONG4, FRAME, ...) must fit
  in the bytes left in the stream;
- memo indices (PUT, LONG_BINPUT) must not run ahead of the opcodes seen;
- unknown opcodes are refused.
Every failure is a `FormatError` naming the file and the byte; a pickle that ends before its
STOP is a `Truncated` (a reader holding only the head of a file may read more and retry).
"""

from __future__ import annotations

import pickletools
import sys
from dataclasses import dataclass

from hybridckpt.errors import FormatError

# -- the opcode table ----------------------------------------------------------------------

_FIXED, _COUNTED, _LINES, _NOARG = 0, 1, 2, 3
_COUNT_FORMS = {  # pickletools argument length codes -> (size bytes, signed)
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _opcode_table() -> list:
    table: list = [None] * 256
    for op in pickletools.opcodes:
        code = ord(op.code)
        arg = op.arg
        if arg is None:
            table[code] = (_NOARG, 0, False)
        elif arg.n >= 0:
            table[code] = (_FIXED, arg.n, False)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[code] = (_LINES, 2 if arg.name.endswith("_pair") else 1, False)
        else:
            size, signed = _COUNT_FORMS[arg.n]
            table[code] = (_COUNTED, size, signed)
    return table


# per opcode byte: (argument kind, size in bytes or lines, signed); None for unknown opcodes
_TABLE = _opcode_table()
_STOP, _FRAME = ord("."), 0x95
_LONG_BINPUT, _PUT = ord("r"), ord("p")
_BINBYTES, _BINBYTES8 = ord("B"), 0x8E
# what the walk notes to name the globals a pickle refers to (`PickleScan.globals`)
_GLOBAL_LINES = (ord("c"), ord("i"))  # GLOBAL, INST: `module\nname\n`
_STACK_GLOBAL, _MEMOIZE = 0x93, 0x94
_STRINGS = (0x8C, ord("X"), 0x8D, ord("U"), ord("T"))  # (SHORT_)BINUNICODE(8), (SHORT_)BINSTRING
_LINE_STRINGS = (ord("V"), ord("S"))  # UNICODE, STRING
_PUTS = {ord("q"): 1, ord("r"): 4}  # BINPUT, LONG_BINPUT (PUT is a line)
_GETS = {ord("h"): 1, ord("j"): 4}  # BINGET, LONG_BINGET (GET is a line)
_GET = ord("g")
_NEUTRAL = (_FRAME, 0x80)  # FRAME, PROTO: no stack effect
_INST, _DUP = ord("i"), ord("2")
_ATOM_OPS = (ord("N"), 0x88, 0x89, ord("Q"))  # NONE, NEWTRUE, NEWFALSE, BINPERSID
_ATOM_BYTES = 256  # strings and bytes up to this long fetched again are not counted as shared
FRAME_SIZE = 9
"""Bytes of one FRAME opcode with its argument (a reader may drop frames: they are hints)."""


class Truncated(FormatError):
    """The pickle runs past the bytes given (a caller may read more and retry)."""


# -- the walk ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PickleScan:
    """What one walk over a pickle found (offsets in bytes of the data walked).

    end:      the offset just after its STOP opcode
    globals:  `(module, name)` of every GLOBAL / INST / STACK_GLOBAL, in order (STACK_GLOBAL's
              names from the two strings pushed just before it, directly or through the memo)
    payloads: `(opcode offset, payload offset, payload length)` of every BINBYTES/BINBYTES8
              of at least the `payload_min_bytes` asked for (none when not asked)
    frames:   the offsets of its FRAME opcodes
    shared:   `(memo index, fetches)` of every memo slot fetched that holds anything but a
              short string, number, global or persistent id: the only way one object gets
              referenced twice (`budget` counts what those fetches add); `((-1, n),)` when
              the walk cannot tell (DUP, an unreadable GET): count the whole result
    """

    end: int
    globals: tuple[tuple[str, str], ...] = ()
    payloads: tuple[tuple[int, int, int], ...] = ()
    frames: tuple[int, ...] = ()
    shared: tuple[tuple[int, int], ...] = ()


def scan_pickle(
    data,
    start: int = 0,
    *,
    what: str,
    stream_end: int | None = None,
    payload_min_bytes: int | None = None,
    judge_frames: bool = True,
) -> PickleScan:
    """Walk one pickle in `data[start:]` (bytes-like or mmap) without running it.

    Length claims are judged against `stream_end` (default `len(data)`), the end of the whole
    stream. Raises `FormatError` for claims past the end, memo indices ahead of the opcodes
    seen, unknown opcodes, and `Truncated` for a pickle that ends before STOP. With
    `payload_min_bytes`, records the BINBYTES/BINBYTES8 payloads of at least that many bytes.
    `judge_frames=False` is for a reader that drops the FRAME opcodes before unpickling (their
    length claims are then never acted on): frames are recorded, not judged.
    A `FormatError` raised by the walk carries `.globals`: the globals seen before it, so a
    refusal can say first what a hostile pickle would have called.
    """
    found = _Globals()
    try:
        return _walk(data, start, what, stream_end, payload_min_bytes, judge_frames, found)
    except FormatError as e:
        e.globals = tuple(found.names)
        raise


class _Globals:
    """The names a pickle refers to, tracked along the walk: the last two values pushed (a string
    or None) and the memo's strings, enough to read STACK_GLOBAL's two operands."""

    def __init__(self) -> None:
        self.names: list[tuple[str, str]] = []
        self.recent: list[str | None] = [None, None]
        self.memo: dict[int, str] = {}
        self.memo_keys: set[int] = set()  # MEMOIZE stores at len(memo), as the unpickler does
        # whether the value on top is an atom (short string, number, None, bool, global,
        # persistent id): False whenever unsure; the memo slots holding atoms; memo fetches of
        # anything else (`PickleScan.shared`)
        self.atom = False
        self.atoms: set[int] = set()
        self.shared: dict[int, int] = {}  # memo index -> fetches (-1: not known which)

    def push(self, value: str | None, atom: bool = False) -> None:
        self.recent = [self.recent[-1], value]
        self.atom = atom

    def get(self, index: int | None) -> None:
        atom = index in self.atoms
        if not atom:
            key = -1 if index is None else index
            self.shared[key] = self.shared.get(key, 0) + 1
        self.push(self.memo.get(index), atom)

    def put(self, index: int) -> None:
        self.memo_keys.add(index)
        if self.atom:
            self.atoms.add(index)
        else:
            self.atoms.discard(index)
        if isinstance(self.recent[-1], str):
            self.memo[index] = self.recent[-1]
        else:
            self.memo.pop(index, None)

    def memoize(self) -> None:
        self.put(len(self.memo_keys))

    def stack_global(self) -> None:
        module, name = self.recent
        if isinstance(module, str) and isinstance(name, str):
            self.names.append((module, name))
        self.push(None, atom=True)


def _text(raw) -> str:
    return bytes(raw[:200]).decode("utf-8", "replace")


def _walk(data, start, what, stream_end, payload_min_bytes, judge_frames, found: _Globals) -> PickleScan:
    n = len(data)
    end = n if stream_end is None else stream_end
    min_payload = sys.maxsize if payload_min_bytes is None else payload_min_bytes
    table = _TABLE
    pos = start
    ops = 0
    payloads: list[tuple[int, int, int]] = []
    frames: list[int] = []
    while True:
        if pos >= n:
            raise Truncated(f"{what}: pickle truncated at byte {pos} (no STOP opcode)")
        code = data[pos]
        spec = table[code]
        if spec is None:
            raise FormatError(f"{what}: not a pickle: unknown opcode {code:#04x} at byte {pos}")
        pos += 1
        kind, size, signed = spec
        if kind == _FIXED:
            if pos + size > n:
                raise Truncated(f"{what}: pickle truncated at byte {pos}")
            if code in _PUTS:
                found.put(int.from_bytes(data[pos : pos + size], "little"))
            elif code in _GETS:
                found.get(int.from_bytes(data[pos : pos + size], "little"))
            elif code not in _NEUTRAL:
                found.push(None, atom=True)  # BININT*, BINFLOAT, EXT*: numbers and globals
            if code == _LONG_BINPUT and int.from_bytes(data[pos : pos + 4], "little") > ops:
                raise FormatError(f"{what}: memo index at byte {pos} runs ahead of the pickle")
            if code == _FRAME:
                if judge_frames and int.from_bytes(data[pos : pos + 8], "little") > end - pos - 8:
                    raise FormatError(f"{what}: frame at byte {pos} claims more bytes than remain")
                frames.append(pos - 1)
            pos += size
        elif kind == _COUNTED:
            if pos + size > n:
                raise Truncated(f"{what}: pickle truncated at byte {pos}")
            length = int.from_bytes(data[pos : pos + size], "little", signed=signed)
            pos += size
            if length < 0 or length > end - pos:
                raise FormatError(
                    f"{what}: opcode {code:#04x} at byte {pos - size - 1} claims {length} bytes "
                    f"but {end - pos} remain"
                )
            if pos + length > n:
                raise Truncated(f"{what}: pickle truncated at byte {pos}")
            if length >= min_payload and code in (_BINBYTES, _BINBYTES8):
                payloads.append((pos - size - 1, pos, length))
            found.push(
                _text(data[pos : pos + min(length, 200)]) if code in _STRINGS else None,
                atom=length <= _ATOM_BYTES,  # a long string or bytes fetched again is counted
            )
            pos += length
        elif kind == _LINES:
            first = pos
            for _ in range(size):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    raise Truncated(f"{what}: pickle truncated at byte {pos}")
                pos = nl + 1
            if code == _PUT:
                try:
                    idx = int(bytes(data[first : pos - 1]))
                except ValueError:
                    raise FormatError(f"{what}: bad PUT argument at byte {first}") from None
                if idx > ops:
                    raise FormatError(
                        f"{what}: memo index at byte {first} runs ahead of the pickle"
                    )
                found.put(idx)
            elif code in _GLOBAL_LINES:
                module, _, name = _text(data[first : pos - 1]).partition("\n")
                found.names.append((module, name))
                found.push(None, atom=code != _INST)
            elif code in _LINE_STRINGS:
                found.push(_text(data[first : pos - 1]).strip("'\""), atom=pos - first <= _ATOM_BYTES)
            elif code == _GET:
                try:
                    found.get(int(bytes(data[first : pos - 1])))
                except ValueError:
                    found.get(None)
            else:
                found.push(None, atom=True)  # INT, LONG, FLOAT, PERSID
        elif code == _STOP:
            shared = ((-1, found.shared[-1]),) if -1 in found.shared else tuple(found.shared.items())
            return PickleScan(pos, tuple(found.names), tuple(payloads), tuple(frames), shared)
        elif code == _STACK_GLOBAL:
            found.stack_global()
        elif code == _MEMOIZE:
            found.memoize()
        else:
            if code == _DUP:
                found.shared[-1] = found.shared.get(-1, 0) + 1
            found.push(None, atom=code in _ATOM_OPS)
        ops += 1


def check_pickle(data, start: int = 0, *, what: str, stream_end: int | None = None) -> int:
    """Scan one pickle in `data[start:]` without running it; return the offset after its STOP.

    Length claims are judged against `stream_end` (default `len(data)`), the end of the whole
    stream. Raises `FormatError` for claims past the end, memo indices ahead of the opcodes
    seen, unknown opcodes, and a pickle that ends before STOP.
    """
    return scan_pickle(data, start, what=what, stream_end=stream_end).end
