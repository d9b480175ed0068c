"""A few pickle opcodes as byte builders, to write hostile pickles by hand (no `__reduce__` of
live objects, so a payload can name any global without importing it).

Every builder returns the opcodes that push ONE object on the unpickler's stack; `stream`
wraps a fragment into a whole protocol-2 pickle. Opcode meanings: CPython Lib/pickletools.py.
"""

from __future__ import annotations

import struct

PROTO2 = b"\x80\x02"
STOP = b"."
MARK = b"("
NONE = b"N"
TRUE = b"\x88"
FALSE = b"\x89"
EMPTY_DICT = b"}"
EMPTY_LIST = b"]"
EMPTY_TUPLE = b")"
REDUCE = b"R"
BUILD = b"b"
SETITEMS = b"u"
APPENDS = b"e"
TUPLE = b"t"
NEWOBJ = b"\x81"


def stream(fragment: bytes) -> bytes:
    """A complete protocol-2 pickle of the object `fragment` pushes."""
    return PROTO2 + fragment + STOP


def glob(module: str, name: str) -> bytes:
    """GLOBAL: push `module.name` (resolved by `find_class`)."""
    return b"c" + f"{module}\n{name}\n".encode()


def stack_glob(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): the two names come from the stack, here as strings."""
    return text(module) + text(name) + b"\x93"


def text(s: str) -> bytes:
    """BINUNICODE."""
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def raw(b: bytes) -> bytes:
    """BINBYTES (protocol 3 opcode; the restricted unpickler reads it in any stream)."""
    return b"B" + struct.pack("<I", len(b)) + b


def integer(n: int) -> bytes:
    """BININT / LONG1."""
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    body = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(body)]) + body


def floating(x: float) -> bytes:
    return b"G" + struct.pack(">d", x)


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def lst(*items: bytes) -> bytes:
    return EMPTY_LIST + (MARK + b"".join(items) + APPENDS if items else b"")


def dct(pairs: dict[str, bytes] | list[tuple[bytes, bytes]]) -> bytes:
    """A dict; keys given as str are pickled as BINUNICODE."""
    items = pairs.items() if isinstance(pairs, dict) else pairs
    body = b"".join((text(k) if isinstance(k, str) else k) + v for k, v in items)
    return EMPTY_DICT + (MARK + body + SETITEMS if body else b"")


def call(fn: bytes, *args: bytes) -> bytes:
    """`fn(*args)` by REDUCE."""
    return fn + tup(*args) + REDUCE


def new(cls: bytes, state: bytes, *args: bytes) -> bytes:
    """`cls.__new__(cls, *args)` by NEWOBJ, then BUILD with `state`."""
    return cls + tup(*args) + NEWOBJ + state + BUILD


def value(x) -> bytes:
    """Opcodes for a plain Python value (None, bool, int, float, str, bytes, tuple, list, dict)."""
    if x is None:
        return NONE
    if x is True:
        return TRUE
    if x is False:
        return FALSE
    if isinstance(x, int):
        return integer(x)
    if isinstance(x, float):
        return floating(x)
    if isinstance(x, str):
        return text(x)
    if isinstance(x, bytes):
        return raw(x)
    if isinstance(x, tuple):
        return tup(*(value(v) for v in x))
    if isinstance(x, list):
        return lst(*(value(v) for v in x))
    if isinstance(x, dict):
        return dct([(value(k), value(v)) for k, v in x.items()])
    raise TypeError(f"no opcodes for {type(x).__name__}")


def namespace(fields: dict[str, bytes]) -> bytes:
    """`argparse.Namespace` with the given attribute opcodes (NEWOBJ + dict BUILD)."""
    return new(glob("argparse", "Namespace"), dct(fields))


def ndarray(data: bytes, shape: tuple[int, ...], dtype: str = "<f4", *, core="numpy._core") -> bytes:
    """A numpy array as numpy pickles it: `_reconstruct(ndarray, (0,), b'b')` + BUILD
    `(1, shape, dtype, False, raw bytes)`."""
    dt = call(glob("numpy", "dtype"), text(dtype[1:] if dtype[0] in "<>|=" else dtype), FALSE, TRUE)
    dt += tup(integer(3), text(dtype[0] if dtype[0] in "<>|" else "<"), NONE, NONE, NONE,
              integer(-1), integer(-1), integer(0)) + BUILD
    arr = call(glob(f"{core}.multiarray", "_reconstruct"), glob("numpy", "ndarray"), tup(integer(0)), raw(b"b"))
    return arr + tup(integer(1), value(tuple(shape)), dt, FALSE, raw(data)) + BUILD
