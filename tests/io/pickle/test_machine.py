"""The restricted unpickler: allowed values round-trip exactly, everything else is refused."""

from __future__ import annotations

import argparse
import collections
import copyreg
import dataclasses
import datetime
import enum
import io
import os
import pathlib
import pickle
import random
import signal
import struct
import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest
import torch

from hybridckpt.containers.pickle.allow import Policy, Stub, is_stub, stub_class
from hybridckpt.containers.pickle.base_policy import BASE_POLICY
from hybridckpt.containers.pickle.machine import safe_load_file, safe_loads
from hybridckpt.containers.pickle.torch_policy import TORCH_DTYPES, TORCH_POLICY, TorchDtype
from hybridckpt.errors import FormatError, HybridCkptError, UnsafePickleError

# -- helpers ---------------------------------------------------------------------------------


def assert_same(got, ref, path="root"):
    """Exact equality, including container and array types, dtypes and bytes."""
    assert type(got) is type(ref), (path, type(got), type(ref))
    if isinstance(ref, np.ndarray):
        assert got.dtype == ref.dtype and got.shape == ref.shape, path
        assert got.tobytes(order="A") == ref.tobytes(order="A"), path
        assert got.flags.f_contiguous == ref.flags.f_contiguous, path
    elif isinstance(ref, dict):
        assert list(got.keys()) == list(ref.keys()), path
        for k in ref:
            assert_same(got[k], ref[k], f"{path}[{k!r}]")
        if hasattr(ref, "__dict__"):
            assert vars(got) == vars(ref), path
        if isinstance(ref, collections.defaultdict):
            assert got.default_factory is ref.default_factory, path
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), path
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(ref, (argparse.Namespace, types.SimpleNamespace)):
        assert_same(vars(got), vars(ref), path)
    elif isinstance(ref, np.generic):
        assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), path
    elif isinstance(ref, float) and ref != ref:
        assert got != got, path
    else:
        assert got == ref, path


def sample_tree():
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64_fortran": np.asfortranarray(rng.standard_normal((2, 5))),
        "i8": np.arange(-4, 4, dtype=np.int8),
        "u32": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "bf16": (rng.standard_normal(5)).astype(ml_dtypes.bfloat16),
        "bool": np.array([True, False, True]),
        "c64": (rng.standard_normal(3) + 1j).astype(np.complex64),
        "empty": np.zeros((0, 3), np.float16),
        "zero_d": np.array(7, np.int64),
        "text": np.array(["ab", "c"]),
        "scalars": [np.float32(2.5), np.int64(-3), np.bool_(True), np.float64("nan")],
        "dtypes": (np.dtype("f2"), np.dtype(ml_dtypes.bfloat16)),
        "ns": argparse.Namespace(lr=1e-3, layers=[1, 2], arr=np.ones(2, np.float32)),
        "sns": types.SimpleNamespace(a=1),
        "od": collections.OrderedDict([("b", 1), ("a", (2, 3))]),
        "counter": collections.Counter("aab"),
        "dd": collections.defaultdict(list, {1: [2]}),
        "set": {1, 2, 3},
        "fs": frozenset({"x"}),
        "complex": 1 + 2j,
        "bytes": b"\x00\xffab",
        "bytearray": bytearray(b"xy"),
        "slice": slice(1, 9, 2),
        "nan": float("nan"),
        "big_int": 2**100,
        "path": pathlib.PurePosixPath("/ckpt/iter_0000010"),
        "when": datetime.datetime(2024, 5, 6, 7, 8, 9),
        "nested": {"a": [{"b": (None, True, "s", 1.5)}]},
    }


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_allowed_values_round_trip_exactly(protocol):
    tree = sample_tree()
    data = pickle.dumps(tree, protocol=protocol)
    ref = pickle.loads(data)  # trusted here: we wrote it
    got = safe_loads(data, what="sample.pkl")
    assert_same(got, ref)
    # arrays come back as plain numpy arrays, never the guarded placeholder class
    assert type(got["f32"]) is np.ndarray and type(got["ns"].arr) is np.ndarray


def test_python2_names_are_mapped():
    # protocol 0 as Python 2 wrote it: `__builtin__.set`, `copy_reg._reconstructor`
    data = b"c__builtin__\nset\n((lp0\nI1\naI2\natp1\nRp2\n."
    assert safe_loads(data, what="py2.pkl") == {1, 2}


def test_torch_names_without_torch():
    obj = {
        "dtypes": [torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn, torch.uint16],
        "key": (torch.float32, torch.float32),
        "size": torch.Size([2, 3]),
        "dev": [torch.device("cpu"), torch.device("cuda", 1)],
        "layout": torch.strided,
    }
    got = safe_loads(pickle.dumps(obj, protocol=2), TORCH_POLICY, what="t.pkl")
    f32, bf16, i64, f8, u16 = got["dtypes"]
    assert f32 == TORCH_DTYPES["float32"] and f32.numpy == np.float32 and f32.itemsize == 4
    assert bf16.numpy == np.dtype(ml_dtypes.bfloat16) and bf16.itemsize == 2
    assert i64.numpy == np.int64 and f8.numpy == np.dtype(ml_dtypes.float8_e4m3fn)
    assert u16.numpy == np.uint16
    assert all(isinstance(d, TorchDtype) for d in got["dtypes"])
    assert got["key"] == (TORCH_DTYPES["float32"], TORCH_DTYPES["float"])  # usable as a dict key
    assert got["size"] == (2, 3) and type(got["size"]) is tuple
    assert got["dev"] == ["cpu", "cuda:1"]
    assert got["layout"] == "torch.strided"
    # every torch dtype torch knows pickles to one we know (none refused)
    for name in dir(torch):
        d = getattr(torch, name)
        if isinstance(d, torch.dtype):
            td = safe_loads(pickle.dumps(d), TORCH_POLICY, what="d")
            assert td.itemsize == d.itemsize, name
    # without the torch names, a torch dtype is refused
    with pytest.raises(UnsafePickleError, match="torch.float32"):
        safe_loads(pickle.dumps(torch.float32), BASE_POLICY, what="t.pkl")


def test_safe_load_file_names_the_file(tmp_path):
    p = tmp_path / "args.pkl"
    p.write_bytes(pickle.dumps({"a": np.arange(3)}))
    np.testing.assert_array_equal(safe_load_file(p)["a"], np.arange(3))
    p.write_bytes(pickle.dumps({"a": 1})[:-3])
    with pytest.raises(FormatError, match=str(p)):
        safe_load_file(p)


# -- attacks -----------------------------------------------------------------------------------


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _attacks(marker: pathlib.Path):
    m = str(marker)
    return {
        "posix.system": _Reduce(os.system, (f"touch {m}",)),
        "builtins.eval": _Reduce(eval, (f"open({m!r}, 'w')",)),
        "builtins.exec": _Reduce(exec, (f"open({m!r}, 'w')",)),
        "subprocess.Popen": _Reduce(subprocess.Popen, (["touch", m],)),
        "builtins.getattr": _Reduce(getattr, (1, "real")),
        "io.open": _Reduce(open, (m, "w")),
        "builtins.__import__": _Reduce(__import__, ("os",)),
    }


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
@pytest.mark.parametrize("name", list(_attacks(pathlib.Path("x"))))
def test_code_execution_is_refused(tmp_path, name, protocol):
    marker = tmp_path / "pwned"
    payload = {"weights": np.ones(2), "evil": [_attacks(marker)[name]]}
    data = pickle.dumps(payload, protocol=protocol)
    for policy in (BASE_POLICY, TORCH_POLICY):
        with pytest.raises(UnsafePickleError) as e:
            safe_loads(data, policy, what="evil.pt")
        assert name in str(e.value) and "evil.pt" in str(e.value)
    assert not marker.exists()


def test_persistent_ids_are_refused():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage-0" if isinstance(obj, bytes) else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"x": b"abc"})
    with pytest.raises(UnsafePickleError, match="persistent id .*p.pkl|p.pkl.*persistent id"):
        safe_loads(buf.getvalue(), what="p.pkl")


def test_reconstructor_only_builds_allowed_classes():
    # copyreg._reconstructor(<function>, object, None) is how protocol 0 builds objects
    good = pickle.dumps(argparse.Namespace(a=[1]), protocol=0)
    assert b"copy_reg\n_reconstructor" in good  # the Python 2 name, mapped like pickle does
    assert safe_loads(good, what="g") == argparse.Namespace(a=[1])
    bad = good.replace(b"cargparse\nNamespace\n", b"c_codecs\nencode\n")
    assert bad != good
    with pytest.raises(UnsafePickleError, match="_reconstructor"):
        safe_loads(bad, what="bad.pkl")
    # copyreg.__newobj__(cls, *args) as protocol 1 writes it
    good = pickle.dumps(_Reduce(copyreg.__newobj__, (collections.OrderedDict,)), protocol=1)
    assert b"__newobj__" in good
    assert safe_loads(good, what="g") == collections.OrderedDict()
    bad = good.replace(b"ccollections\nOrderedDict\n", b"c_codecs\nencode\n")
    assert bad != good
    with pytest.raises(UnsafePickleError, match="__newobj__"):
        safe_loads(bad, what="bad.pkl")


def test_sized_constructors_are_refused():
    # bytes(10**12) / bytearray(10**12) would allocate a terabyte
    for fn in (bytes, bytearray):
        data = pickle.dumps(_Reduce(fn, (10**12,)), protocol=2)
        with pytest.raises(UnsafePickleError, match="size"):
            safe_loads(data, what="alloc.pkl")


def _build_on_global(module: str, name: str, state: bytes) -> bytes:
    """A pickle that loads a global and BUILDs `state` (pickle opcodes) onto it."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + state + b"b."


def _attr(key: str, value_global: bytes = b"cbuiltins\nset\n") -> bytes:
    """Pickle opcodes for the BUILD state `(None, {key: <global>})`: slot state, set by setattr."""
    k = key.encode()
    return b"N}X" + struct.pack("<I", len(k)) + k + value_global + b"s\x86"


@pytest.mark.parametrize(
    "module, name, key",
    [
        ("argparse", "Namespace", "__eq__"),
        ("collections", "Counter", "update"),
        ("torch", "float32", "itemsize"),
        ("torch", "Size", "fn"),
        ("torch", "Size", "__defaults__"),
        ("ml_dtypes", "bfloat16", "__init__"),
        ("numpy", "ndarray", "name"),
        ("megatron.core.enums", "ModelType", "__setstate__"),
        ("collections", "OrderedDict", "fromkeys"),
    ],
)
def test_shared_globals_cannot_be_patched(module, name, key):
    before_ns = dict(vars(argparse.Namespace))
    data = _build_on_global(module, name, _attr(key))
    with pytest.raises(HybridCkptError, match="patch.pkl"):
        safe_loads(data, TORCH_POLICY, what="patch.pkl")
    # nothing shared changed: the next load sees the same classes and constants
    assert dict(vars(argparse.Namespace)) == before_ns and "update" in vars(collections.Counter)
    assert collections.Counter("aa") == {"a": 2}
    assert TORCH_DTYPES["float32"].itemsize == 4
    assert safe_loads(pickle.dumps(torch.Size([2])), TORCH_POLICY, what="x") == (2,)
    assert not hasattr(stub_class("megatron.core.enums", "ModelType"), "x")
    assert "__setstate__" not in vars(stub_class("megatron.core.enums", "ModelType"))


def test_dict_state_on_constants_is_refused():
    state = b"}X" + struct.pack("<I", 8) + b"itemsize" + b"K\x01s"
    with pytest.raises(FormatError, match="c.pkl"):
        safe_loads(_build_on_global("torch", "float32", state), TORCH_POLICY, what="c.pkl")
    assert TORCH_DTYPES["float32"].itemsize == 4


# -- numpy guards ----------------------------------------------------------------------------


def test_object_and_structured_arrays_are_refused():
    for arr in (
        np.array([1, "a", None], dtype=object),
        np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
        np.zeros(2, dtype=[("v", "f4", (2,))]),
    ):
        for protocol in (2, 4, 5):
            with pytest.raises(UnsafePickleError, match="numpy"):
                safe_loads(pickle.dumps({"x": arr}, protocol=protocol), what="np.pkl")
    with pytest.raises(UnsafePickleError):
        safe_loads(pickle.dumps(np.dtype(object)), what="np.pkl")
    with pytest.raises(UnsafePickleError):
        safe_loads(pickle.dumps(np.array(["x", 1], dtype=object)[0:1][0:1]), what="np.pkl")


class _ForgedDtype:
    def __init__(self, state, copy=False):
        self.state, self.copy = state, copy

    def __reduce__(self):
        return np.dtype, ("i8", False, self.copy), self.state


class _ForgedArray:
    def __init__(self, dtype, raw, shape=(2,)):
        self.dtype, self.raw, self.shape = dtype, raw, shape

    def __reduce__(self):
        from numpy._core.multiarray import _reconstruct

        return _reconstruct, (np.ndarray, (0,), b"b"), (1, self.shape, self.dtype, False, self.raw)


def test_forged_dtype_state_cannot_touch_numpy():
    # copy=False + BUILD would mutate numpy's shared int64 descriptor; flags 63 claims objects
    before = np.dtype("i8")
    forged = _ForgedDtype((3, ">", None, None, None, -1, -1, 63), copy=False)
    arr = _ForgedArray(forged, struct.pack(">qq", 5, -6))
    got = safe_loads(pickle.dumps({"d": forged, "a": arr}, protocol=2), what="forge.pkl")
    assert np.dtype("i8") is before and np.dtype("i8").byteorder == "="
    assert got["d"] == np.dtype(">i8") and not got["d"].hasobject
    assert type(got["a"]) is np.ndarray and got["a"].tolist() == [5, -6]
    # structured state on a plain dtype is refused
    fields = _ForgedDtype((3, "|", None, ("a",), {"a": (np.dtype("i8"), 0)}, 8, 1, 0))
    with pytest.raises(UnsafePickleError, match="structured"):
        safe_loads(pickle.dumps(fields, protocol=2), what="forge.pkl")
    # raw bytes that do not match the shape
    short = _ForgedArray(_ForgedDtype((3, "<", None, None, None, -1, -1, 0)), b"\x00" * 15)
    with pytest.raises(FormatError, match="forge.pkl.*16 bytes"):
        safe_loads(pickle.dumps(short, protocol=2), what="forge.pkl")


def test_reconstruct_only_makes_ndarrays():
    from numpy._core.multiarray import _reconstruct

    data = pickle.dumps(_Reduce(_reconstruct, (collections.OrderedDict, (0,), b"b")), protocol=2)
    with pytest.raises(UnsafePickleError, match="_reconstruct"):
        safe_loads(data, what="r.pkl")
    # NEWOBJ on numpy.ndarray must not allocate an array of the claimed size
    data = b"\x80\x02cnumpy\nndarray\nJ\x00\x00\x00\x40\x85\x81."
    with pytest.raises(FormatError, match="n.pkl"):
        safe_loads(data, what="n.pkl")


# -- stubs -----------------------------------------------------------------------------------


@pytest.fixture
def fake_megatron(monkeypatch):
    """Throwaway `megatron.core.enums` etc., present only while the test pickles them."""
    mods = {}
    for name in ("megatron", "megatron.core", "megatron.core.enums", "megatron.core.optimizer"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])

    class ModelType(enum.Enum):
        encoder_or_decoder = 1
        encoder_and_decoder = 2

    @dataclasses.dataclass
    class OptimizerConfig:
        lr: float
        params_dtype: object

    def build_thing(x):
        return x

    for obj, mod in (
        (ModelType, "megatron.core.enums"),
        (OptimizerConfig, "megatron.core.optimizer"),
        (build_thing, "megatron.core.optimizer"),
    ):
        obj.__module__ = mod
        obj.__qualname__ = obj.__name__
        setattr(mods[mod], obj.__name__, obj)
    return types.SimpleNamespace(
        ModelType=ModelType, OptimizerConfig=OptimizerConfig, fn=build_thing
    )


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_framework_classes_become_inert_stubs(fake_megatron, monkeypatch, protocol):
    args = argparse.Namespace(
        model_type=fake_megatron.ModelType.encoder_or_decoder,
        exit_signal=signal.SIGTERM,
        params_dtype=torch.bfloat16,
        hidden_size=64,
    )
    obj = {
        "args": args,
        "cfg": fake_megatron.OptimizerConfig(lr=0.5, params_dtype=torch.float32),
        "call": _Reduce(fake_megatron.fn, (7,)),
    }
    data = pickle.dumps(obj, protocol=protocol)
    for name in ("megatron", "megatron.core", "megatron.core.enums", "megatron.core.optimizer"):
        monkeypatch.delitem(sys.modules, name)

    with pytest.raises(UnsafePickleError, match=r"megatron\.core\.enums\.ModelType.*|.*megatron"):
        safe_loads(data, BASE_POLICY, what="model_optim_rng.pt")

    got = safe_loads(data, TORCH_POLICY, what="model_optim_rng.pt")
    a = got["args"]
    assert isinstance(a, argparse.Namespace) and a.hidden_size == 64
    assert is_stub(a.model_type, "megatron.core.enums.ModelType")
    assert a.model_type.stub_args == (1,)
    assert type(a.model_type) is stub_class("megatron.core.enums", "ModelType")
    assert is_stub(a.exit_signal, "signal.Signals") and a.exit_signal.stub_args == (
        int(signal.SIGTERM),
    )
    assert a.params_dtype == TORCH_DTYPES["bfloat16"]
    cfg = got["cfg"]
    assert is_stub(cfg, "megatron.core.optimizer.OptimizerConfig")
    assert cfg.lr == 0.5 and cfg.params_dtype == TORCH_DTYPES["float32"]
    assert is_stub(got["call"], "megatron.core.optimizer.build_thing") and got[
        "call"
    ].stub_args == (7,)
    assert "megatron.core.enums" not in sys.modules  # nothing was imported


def test_stub_records_state_items_and_appends():
    cls = stub_class("deepspeed.runtime.zero", "Thing")
    s = cls.__new__(cls, 1, k=2)
    s.__setstate__(({"numel": 4, "stub_args": "spoof", "__class__": int}, {"start": 8}))
    s["a"] = 1
    s.extend([1, 2])
    assert s.stub_args == (1,) and s.stub_kwargs == {"k": 2}
    assert s.numel == 4 and s.start == 8 and type(s) is cls
    assert s.stub_items == {"a": 1} and s.stub_list == [1, 2]
    assert "deepspeed.runtime.zero.Thing" in repr(s)
    assert isinstance(s, Stub) and not is_stub(s, "deepspeed.Other")


def test_policy_prefix_matching():
    p = Policy({}, ("paddle.", "signal.Signals"))
    assert p.is_stubbed("paddle.framework.io.Foo") and p.is_stubbed("paddle.Tensor")
    assert not p.is_stubbed("paddlex.Foo") and not p.is_stubbed("signal.SIGTERM")
    assert p.is_stubbed("signal.Signals")
    merged = BASE_POLICY.merged(p)
    assert merged.is_stubbed("paddle.x") and ("builtins", "set") in merged.allowed
    assert BASE_POLICY.merged(None) is BASE_POLICY


# -- nesting and fuzzing (length and memo guards: test_opcodes.py) ---------------------------


def test_deep_nesting_is_a_format_error_or_loads():
    depth = 200_000
    data = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    out = safe_loads(data, what="deep.pkl")  # the C unpickler does not recurse
    assert isinstance(out, list)
    # with an array inside, the clean-up walk recurses: a FormatError, not a crash
    arr = pickle.dumps(np.zeros(1), protocol=2)[2:-1]
    data = b"\x80\x02" + b"]" * depth + arr + b"a" * depth + b"."
    with pytest.raises(FormatError, match="deep.pkl.*Recursion"):
        safe_loads(data, what="deep.pkl")


def test_fuzzed_pickles_only_raise_project_errors():
    base = pickle.dumps(sample_tree(), protocol=2)
    base4 = pickle.dumps(sample_tree(), protocol=4)
    rng = random.Random(1234)
    for i in range(600):
        data = bytearray(base if i % 2 else base4)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            data[pos] = rng.randrange(256)
        if i % 5 == 0:
            data = data[: rng.randrange(len(data))]
        try:
            safe_loads(bytes(data), TORCH_POLICY, what="fuzz.pkl")
        except HybridCkptError as e:
            assert "fuzz.pkl" in str(e)
