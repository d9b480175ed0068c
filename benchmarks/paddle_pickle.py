"""Write `paddle.save` pickles with the arrays' bytes as holes: sparse sources of any size.

`paddle.save` (PaddlePaddle/Paddle: python/paddle/framework/io.py, 3.3.1) pickles the arrays
INLINE, so a many-rank Paddle checkpoint cannot be made sparse by the tool itself. This module
writes the same bytes by hand, for the two forms paddle.save has:

- a state dict (`_legacy_save`, chosen when every value is a tensor or a dict holding none):
  `{key: ndarray, ..., "StructuredToParameterName@@": {key: tensor.name}}` (`state_dict`);
- any other object (`_pickle_save`: an optimizer dict holding `master_weights`): each tensor as
  `builtins.tuple((tensor.name, ndarray))` (`Named`).

An ndarray pickles (numpy's `__reduce_ex__`, protocol 4) as
`numpy.core.multiarray._reconstruct(numpy.ndarray, (0,), b'b')` + BUILD
`(1, shape, dtype, False, raw bytes)`, its dtype as `numpy.dtype(code, False, True)` + BUILD
`(3, order, None, None, None, -1, -1, 0)`. Python's own pickler (`pickle._Pickler`, whose framing
and memo are those of the C pickler paddle uses) writes everything; an `Array` without data
writes its payload's opcode header and then SEEKS past the payload when the payload is at least
pickle's frame target (64 KiB: the pickler writes such payloads outside a frame, straight to the
file), else writes that many zero bytes. The file has the real size, the holes read as zeros,
and costs the disk only its headers. `tests/jobs/test_paddle_pickle.py` shows the bytes equal
paddle.save's: the real corpus files (payloads filled with theirs) and, for payloads of 64 KiB
and more, the record of paddle 3.3.1 saving zero arrays (`tests/real/paddle_save_layout.json`,
by `tests/real/generators/paddle_save_layout.py`).

What paddle.save's objects share decides its memo: `tensor.name` is a fresh string on every
access (never a memo hit on an equal key), the name table's keys are the state dict's own key
objects (memo hits), every float32 array shares one dtype object. `state_dict` and `Named`
keep those identities; callers must not reuse one `Array` or one name string in two places.

Runs under the project's Python and under the side venvs' (no numpy needed).
"""

from __future__ import annotations

import pickle
import struct

NAME_TABLE = "StructuredToParameterName@@"
NUMPY_CORE = "numpy.core"  # numpy 1.x, as the corpus's paddle venvs pickle; numpy 2 writes numpy._core
_ITEMSIZE = {"f4": 4, "f2": 2, "u2": 2, "f8": 8, "i8": 8, "i4": 4, "u1": 1, "i1": 1, "b1": 1}
_FRAME_TARGET = 64 * 1024


class _Global:
    """A module-level name the pickle refers to (saved as STACK_GLOBAL, memoized)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle's save_reduce asks for a callable
        raise TypeError("a stand-in for pickling only")


class _Dtype:
    """A numpy dtype as its `__reduce__` gives it (one object per code: numpy's are singletons)."""

    def __init__(self, g: _Global, code: str):
        self.g, self.code = g, code

    def __reduce_ex__(self, proto):
        order = "|" if _ITEMSIZE[self.code] == 1 else "<"
        return (self.g, (self.code, False, True), (3, order, None, None, None, -1, -1, 0))


class Array:
    """An ndarray as paddle.save pickles it: `shape`, numpy dtype `code` ('f4', 'u2' for
    bfloat16 bits, ...), and its raw C-order bytes `data` (None: zeros, a hole when large)."""

    def __init__(self, shape, code: str, data: bytes | None = None):
        self.shape, self.code, self.data = tuple(int(s) for s in shape), code, data
        n = _ITEMSIZE[code]
        for s in self.shape:
            n *= s
        self.nbytes = n
        if data is not None and len(data) != n:
            raise ValueError(f"{len(data)} bytes for {self.shape} {code}")


class _Hole:
    """`n` bytes the pickle states and the file leaves unwritten."""

    def __init__(self, n: int):
        self.n = n


class Named:
    """A paddle Tensor pickled by `_pickle_save`: `builtins.tuple(((name, ndarray),))`."""

    def __init__(self, name: str, array: Array):
        self.name = "".join(list(name))  # a fresh string, as `tensor.name` is
        self.array = array


def state_dict(tensors: dict, names: dict[str, str]) -> dict:
    """What `_build_saved_state_dict` pickles: `tensors` (key -> Array, or a dict holding no
    tensor such as `LR_Scheduler`) and the name table {key: names[key]} for each Array."""
    out, table = {}, {}
    for k, v in tensors.items():
        out[k] = v
        if isinstance(v, Array):
            table[k] = "".join(list(names[k]))
    out[NAME_TABLE] = table
    return out


class _Writer(pickle._Pickler):
    dispatch = pickle._Pickler.dispatch.copy()

    def __init__(self, file, numpy_core: str):
        super().__init__(file, 4)
        self._raw = file
        self._g = {}
        self.holes = 0
        self._reconstruct = self._global(numpy_core + ".multiarray", "_reconstruct")
        self._ndarray = self._global("numpy", "ndarray")
        self._dtypes: dict[str, _Dtype] = {}

    def _global(self, module: str, name: str) -> _Global:
        return self._g.setdefault((module, name), _Global(module, name))

    def _save_global_obj(self, obj):
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_array(self, obj):
        dt = self._dtypes.get(obj.code)
        if dt is None:
            dt = self._dtypes[obj.code] = _Dtype(self._global("numpy", "dtype"), obj.code)
        raw = obj.data if obj.data is not None else (
            _Hole(obj.nbytes) if obj.nbytes >= _FRAME_TARGET else bytes(obj.nbytes))
        state = (1, tuple(list(obj.shape)), dt, False, raw)
        self.save_reduce(self._reconstruct, (self._ndarray, tuple([0]), b"b"), state, obj=obj)

    def _save_named(self, obj):
        self.save_reduce(self._global("builtins", "tuple"), ((obj.name, obj.array),), obj=obj)

    def _save_hole(self, obj):
        n = obj.n
        head = (pickle.BINBYTES8 + struct.pack("<Q", n)) if n > 0xFFFFFFFF else (
            pickle.BINBYTES + struct.pack("<I", n))
        self.framer.write_large_bytes(head, b"")  # what pickle does for a payload >= 64 KiB
        self._raw.seek(n, 1)
        self.holes += n
        self.memoize(obj)

    dispatch[_Global] = _save_global_obj
    dispatch[Array] = _save_array
    dispatch[Named] = _save_named
    dispatch[_Hole] = _save_hole


def dump(obj, path: str, *, numpy_core: str = NUMPY_CORE) -> dict:
    """Write `obj` (dicts, lists, scalars, strings, `Array`, `Named`) as paddle.save would at
    protocol 4. Returns {"bytes": file size, "holes": bytes left as holes}."""
    with open(path, "wb") as f:
        w = _Writer(f, numpy_core)
        w.dump(obj)
        size = f.tell()
        f.truncate(size)
    return {"bytes": size, "holes": w.holes}
