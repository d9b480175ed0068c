"""paddle.save pickles (`.pdparams`, `.pdopt`), read without paddle and lazily.

Format (PaddlePaddle/Paddle:python/paddle/framework/io.py `save`, `_legacy_save`,
`_pickle_save`; io_utils.py `_unpack_saved_dict`; checked against paddlepaddle 3.3.1):
- A pickle (protocol 4 by default, 2 or 3 when asked) of nested dicts. numpy arrays pickle as
  `numpy[._core|.core].multiarray._reconstruct(ndarray, (0,), b'b')` + BUILD state
  `(1, shape, dtype, fortran, raw bytes)`; protocol 2 writes the raw bytes as
  `_codecs.encode(<latin-1 text>, 'latin1')`.
- "State dict" form (`_is_state_dict`: every value a tensor, or a dict holding no tensor, such as
  `LR_Scheduler`): tensors become plain arrays and a top-level `StructuredToParameterName@@`
  `{key: tensor.name}` is added. With protocol 2/3, arrays over `(2**30 - 1) // itemsize`
  elements are flattened and split into `key@@.0`, `key@@.1`, ... plus
  `UnpackBigParamInfor@@: {key: {"OriginShape": shape, "slices": [part keys]}}`.
- Any other object (an optimizer dict holding `master_weights`): each tensor pickles as a
  `(tensor.name, ndarray)` tuple (`builtins.tuple` REDUCE) and there is no name table.
- bfloat16 tensors are stored as `uint16` arrays of the raw bits; the caller knows (from the
  config or `model_meta.json`) which ones to view as bfloat16 (`reinterpret`).
- Framework objects (paddle generator states, paddlenlp classes) become inert stubs.

Laziness: protocol 3/4 pickles hold each array's bytes as one BINBYTES/BINBYTES8 payload.
`safe_load` walks the opcodes by preads with the one opcode walk (`opcodes.scan_pickle` over an
`io.pread_view.PreadView`: never a mapping, which a file truncated meanwhile would turn into a
SIGBUS; payloads are never read: the view's windows are small after each jump and its fd is
advised FADV_RANDOM, else the kernel's read-ahead reads up to `read_ahead_kb` of the payload
after every header: 8 MiB here, a whole 16 MiB file to open it), drops the FRAME opcodes (a
read-ahead hint only), replaces each
payload of at least `lazy_min_bytes` by a persistent-id reference, unpickles the small remainder
with the restricted unpickler (no second walk), and returns `StoredTensor`s at the payloads'
file offsets: opening a file reads its pickle opcodes only, and a box of a tensor reads only
that box.
Smaller payloads and protocol 2 text payloads are read eagerly.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.pickle.allow import Contextual, Policy, Stub, UnpicklerView, short_repr
from hybridckpt.containers.pickle.base_policy import BASE_ALLOWED
from hybridckpt.containers.pickle.machine import (
    RestrictedUnpickler,
    refuse_named_threat,
    safe_loads,
)
from hybridckpt.containers.pickle.numpy_guard import NDARRAY
from hybridckpt.containers.pickle.opcodes import FRAME_SIZE, scan_pickle
from hybridckpt.errors import FormatError, UnsafePickleError
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.io.pread_view import PreadView
from hybridckpt.lazy import ArrayTensor, LazyTensor, StoredTensor

NAME_TABLE = "StructuredToParameterName@@"
BIG_PARAM_INFO = "UnpackBigParamInfor@@"
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# -- the lazy load ------------------------------------------------------------------------

_BINUNICODE, _BINPERSID = b"X", b"Q"
LAZY_MIN_BYTES = 4096


@dataclass(frozen=True)
class _Payload:
    """Raw array bytes left in the file: `length` bytes at `offset` of `path`."""

    path: str
    offset: int
    length: int


class _PaddleUnpickler(RestrictedUnpickler):
    """Resolves the persistent ids `safe_load` put in place of large payloads (and nothing else)."""

    def __init__(self, file, policy, *, what, encoding="latin1", payloads=None, nonce=""):
        super().__init__(file, policy, what=what, encoding=encoding)
        self.payloads = payloads or []
        self.nonce = nonce

    def persistent_load(self, pid):
        if isinstance(pid, str) and self.nonce and pid.startswith(self.nonce + ":"):
            try:
                return self.payloads[int(pid[len(self.nonce) + 1 :])]
            except (ValueError, IndexError):
                pass
        return super().persistent_load(pid)


class _ArraySlot:
    """What `_reconstruct(ndarray, ...)` returns under PADDLE_POLICY: BUILD fills `value` with an
    ndarray (inline bytes) or a `StoredTensor` (a payload left in the file)."""

    def __init__(self, what: str):
        self.what = what
        self.value: object = None

    def __setstate__(self, state):
        what = self.what
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise FormatError(f"{what}: bad numpy array state {short_repr(state)}")
        shape, spec, fortran, raw = state[-4:]
        dt = (
            spec if isinstance(spec, np.dtype) else getattr(spec, "dtype", None)
        )  # numpy_guard's checked dtype
        if not isinstance(dt, np.dtype):
            raise FormatError(f"{what}: expected a numpy dtype, found {short_repr(spec)}")
        try:
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            raise FormatError(f"{what}: bad numpy shape {short_repr(shape)}") from None
        if any(s < 0 for s in shape):
            raise FormatError(f"{what}: negative numpy shape {shape}")
        count = 1
        for s in shape:
            count *= s
        want = count * dt.itemsize
        if isinstance(raw, _Payload):
            if raw.length != want:
                raise FormatError(
                    f"{what}: numpy array {shape} of {dt} needs {want} bytes, found {raw.length}"
                )
            src = ByteSource(raw.path)
            if fortran and len(shape) > 1:
                t = StoredTensor(src, raw.offset, shape[::-1], dt)
                self.value = lazy.transpose(t)
            else:
                self.value = StoredTensor(src, raw.offset, shape, dt)
            return
        if isinstance(raw, str):  # protocol 2: latin-1 text holding the bytes
            raw = raw.encode("latin1")
        if not isinstance(raw, (bytes, bytearray)):
            raise FormatError(f"{what}: expected raw array bytes, found {type(raw).__name__}")
        if len(raw) != want:
            raise FormatError(
                f"{what}: numpy array {shape} of {dt} needs {want} bytes, found {len(raw)}"
            )
        arr = np.frombuffer(raw, dtype=dt).reshape(shape, order="F" if fortran else "C")
        self.value = np.ascontiguousarray(arr)


def _reconstruct(unp: UnpicklerView):
    def reconstruct(cls, shape, typecode):
        if cls is not NDARRAY:
            raise UnsafePickleError(
                f"{unp.what}: numpy _reconstruct of {short_repr(cls)} is not allowed"
            )
        return _ArraySlot(unp.what)

    return reconstruct


PADDLE_POLICY = Policy(
    {
        **BASE_ALLOWED,
        **{
            (f"{core}.multiarray", "_reconstruct"): Contextual(_reconstruct)
            for core in ("numpy.core", "numpy._core")
        },
    },
    ("paddle.", "paddlenlp.", "paddleformers.", "paddlefleet."),
)
"""Plain containers, `builtins.tuple` (the `(name, ndarray)` form), guarded numpy arrays (lazy
when large), `_codecs.encode` (protocol 2); paddle/paddlenlp/paddleformers globals become stubs
(PaddleFormers' Trainer pickles its `TrainingArguments` into `training_args.bin`)."""


def _unslot(x, seen=None):
    """Replace every `_ArraySlot` by its value (ndarray or StoredTensor), in place where possible."""
    seen = {} if seen is None else seen
    if id(x) in seen:
        return seen[id(x)]
    if isinstance(x, _ArraySlot):
        if x.value is None:
            raise FormatError(f"{x.what}: numpy array without its state")
        return x.value
    if isinstance(x, dict):
        seen[id(x)] = x
        for k in list(x):
            x[k] = _unslot(x[k], seen)
        return x
    if isinstance(x, list):
        seen[id(x)] = x
        x[:] = [_unslot(v, seen) for v in x]
        return x
    if isinstance(x, tuple):
        return tuple(_unslot(v, seen) for v in x)
    if isinstance(x, Stub):
        seen[id(x)] = x
        for k, v in list(vars(x).items()):
            vars(x)[k] = _unslot(v, seen)
    return x


def safe_load(path: str, *, lazy_min_bytes: int = LAZY_MIN_BYTES) -> object:
    """Unpickle the paddle.save file `path` under `PADDLE_POLICY`.

    Returns the saved object: dicts, lists, `(name, array)` tuples, scalars, stubs; array leaves
    are `numpy.ndarray` (small, or protocol-2 text) or `StoredTensor` (payloads of at least
    `lazy_min_bytes` bytes, read on demand). Raises FormatError for a file that is
    not a valid pickle and UnsafePickleError for globals off the allow-list.
    """
    with PreadView(path) as data:  # preads, never a mapping: a file shrunk meanwhile is an error, not a SIGBUS
        if len(data) == 0:
            raise FormatError(f"{path}: empty file, not a paddle.save pickle")
        try:
            scan = scan_pickle(data, what=path, payload_min_bytes=lazy_min_bytes, judge_frames=False)
        except FormatError as e:
            refuse_named_threat(e, PADDLE_POLICY, path)
            raise
        nonce = "hybridckpt-" + secrets.token_hex(8)
        # cuts: FRAME opcodes are dropped (framing is only a read-ahead hint, and the
        # stream changes length), large payloads become persistent-id references
        cuts: list[tuple[int, int, bytes]] = [(f, f + FRAME_SIZE, b"") for f in scan.frames]
        payloads = []
        for i, (op, off, length) in enumerate(scan.payloads):
            pid = f"{nonce}:{i}".encode()
            cuts.append((op, off + length, _BINUNICODE + len(pid).to_bytes(4, "little") + pid + _BINPERSID))
            payloads.append(_Payload(path, off, length))
        cuts.sort()
        parts, pos = [], 0
        for a, b, rep in cuts:
            parts.append(data[pos:a])
            parts.append(rep)
            pos = b
        parts.append(data[pos:])
        stream = b"".join(parts)
        data.check_unchanged()  # the walk's bytes are one version of the file
    obj = safe_loads(
        stream,
        PADDLE_POLICY,
        what=path,
        unpickler_cls=_PaddleUnpickler,
        walked=True,  # the walk above, on the file: one walk per file, not two
        payloads=payloads,
        nonce=nonce,
    )
    try:
        return _unslot(obj)
    except RecursionError:
        raise FormatError(f"{path}: pickle nests too deeply") from None


# -- state dicts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaddleDict:
    """One dict level of a paddle.save file, normalised.

    tensors:  key -> tensor (big params re-joined lazily; `(name, array)` tuples unwrapped)
    names:    key -> paddle variable name (`linear_0.w_0`), from the name table or the tuples
    children: key -> nested PaddleDict (e.g. `master_weights`)
    extra:    every other entry as loaded (`LR_Scheduler`, scalars, stubs)
    path:     the file, for error messages
    """

    path: str
    tensors: Mapping[str, LazyTensor] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)
    children: Mapping[str, PaddleDict] = field(default_factory=dict)
    extra: Mapping[str, object] = field(default_factory=dict)
    tuple_form: bool = False


def _as_tensor(x) -> LazyTensor | None:
    if isinstance(x, LazyTensor):
        return x
    if isinstance(x, np.ndarray):
        return ArrayTensor(x)
    return None


def _is_named_tensor(x) -> bool:
    return (
        isinstance(x, tuple)
        and len(x) == 2
        and isinstance(x[0], str)
        and _as_tensor(x[1]) is not None
    )


def _join_big_params(d: dict, path: str, key: str = "") -> None:
    """Undo `_unpack_saved_dict`: concatenate `key@@.i` parts (1-D) and reshape, lazily."""
    info = d.pop(BIG_PARAM_INFO, None)
    if info is None:
        return
    if not isinstance(info, dict):
        raise FormatError(f"{path}: {BIG_PARAM_INFO} is {type(info).__name__}, expected a dict")
    for name, entry in info.items():
        try:
            shape = tuple(int(s) for s in entry["OriginShape"])
            slices = list(entry["slices"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(
                f"{path}: {BIG_PARAM_INFO}[{name!r}]: expected OriginShape and slices, found "
                f"{short_repr(entry)}"
            ) from None
        parts = []
        for s in slices:
            if s not in d:
                raise FormatError(f"{path}: big parameter {name!r}: part {s!r} is missing")
            t = _as_tensor(d.pop(s))
            if t is None or t.ndim != 1:
                raise FormatError(f"{path}: big parameter {name!r}: part {s!r} is not a 1-D array")
            parts.append(t)
        if not parts:
            raise FormatError(f"{path}: big parameter {name!r} has no parts")
        flat = lazy.concat(parts, 0)
        total = flat.shape[0]
        want = math.prod(shape)  # (exact: an int64 product wraps to whatever the parts hold)
        if total != want:
            raise FormatError(
                f"{path}: big parameter {name!r}: parts hold {total} elements, OriginShape "
                f"{shape} needs {want}"
            )
        d[name] = lazy.reshape(flat, shape)


def normalize(obj, path: str) -> PaddleDict:
    """The PaddleDict of a loaded top-level object (must be a dict)."""
    if not isinstance(obj, dict):
        raise FormatError(
            f"{path}: expected a dict saved by paddle.save, found {type(obj).__name__}"
        )
    obj = dict(obj)
    _join_big_params(obj, path)
    table = obj.pop(NAME_TABLE, None)
    if table is not None and not isinstance(table, dict):
        raise FormatError(f"{path}: {NAME_TABLE} is {type(table).__name__}, expected a dict")
    tensors: dict[str, LazyTensor] = {}
    names: dict[str, str] = {}
    children: dict[str, PaddleDict] = {}
    extra: dict[str, object] = {}
    tuple_form = False
    for key, value in obj.items():
        t = _as_tensor(value)
        if t is not None:
            tensors[key] = t
        elif _is_named_tensor(value):
            tensors[key] = _as_tensor(value[1])
            names[key] = value[0]
            tuple_form = True
        elif isinstance(value, dict) and any(
            _as_tensor(v) is not None or _is_named_tensor(v) for v in value.values()
        ):
            children[key] = normalize(value, f"{path}:{key}")
        else:
            extra[key] = value
    for key, name in (table or {}).items():
        if isinstance(name, str):
            names.setdefault(key, name)
    return PaddleDict(path, tensors, names, children, extra, tuple_form)


def read(path: str) -> PaddleDict:
    """`safe_load` + `normalize`: the tensors, names and other entries of a paddle.save dict file."""
    return normalize(safe_load(path), path)


# -- dtype views ---------------------------------------------------------------------------------


def reinterpret(t: LazyTensor, dtype) -> LazyTensor:
    """`t` with its bytes viewed as another dtype of the same itemsize (uint16 bits -> bfloat16).

    Pushed down into the views paddle files produce (stored, in-memory, joined big params) so
    reads stay single views; any other view gets a `lazy.Bitcast` on top."""
    dtype = np.dtype(dtype)
    if np.dtype(t.dtype) == dtype:
        return t
    if np.dtype(t.dtype).itemsize != dtype.itemsize:
        raise FormatError(f"cannot view {t.dtype} as {dtype}: item sizes differ")
    if isinstance(t, StoredTensor):
        return replace(t, dtype=dtype)
    if isinstance(t, ArrayTensor):
        return ArrayTensor(t.array.view(dtype))
    if isinstance(t, lazy.Concat):
        return lazy.Concat(tuple(reinterpret(p, dtype) for p in t.parts), t.axis)
    if isinstance(t, lazy.Reshape):
        return lazy.Reshape(reinterpret(t.src, dtype), t.shape)
    if isinstance(t, lazy.Transpose):
        return lazy.Transpose(reinterpret(t.src, dtype), t.perm)
    if isinstance(t, lazy.Slice):
        return lazy.Slice(reinterpret(t.src, dtype), t.region)
    return lazy.Bitcast(t, dtype)
