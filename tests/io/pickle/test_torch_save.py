"""torch.save files read without torch, compared bit for bit with torch.load."""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import random
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.pickle.allow import Policy, is_stub
from hybridckpt.containers.pickle.torch_policy import TORCH_DTYPES, TorchDtype
from hybridckpt.errors import FormatError, HybridCkptError, UnsafePickleError
from hybridckpt.io.byte_source import close_all, count_reads
from hybridckpt.lazy import LazyTensor

# -- helpers ---------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as numpy, with dtypes numpy lacks viewed as unsigned bits."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def our_bits(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return a.view(np.uint16)
    if a.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
        return a.view(np.uint8)
    return a


NP_OF = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.uint16: np.uint16,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
}


def assert_tensor(got, ref: torch.Tensor, where="tensor"):
    assert isinstance(got, LazyTensor), (where, type(got))
    assert got.shape == tuple(ref.shape), where
    assert np.dtype(got.dtype) == np.dtype(NP_OF[ref.dtype]), where
    a, b = our_bits(got.read()), bits(ref)
    assert a.dtype == b.dtype and np.array_equal(a, b), where


def assert_tree(got, ref, where="root"):
    """Our load vs torch.load: tensors bitwise, torch names mapped, everything else equal."""
    if isinstance(ref, torch.Tensor):
        assert_tensor(got, ref, where)
    elif isinstance(ref, dict):
        assert type(got) is type(ref) and list(got) == list(ref), where
        for k in ref:
            assert_tree(got[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, torch.Size):
        assert got == tuple(ref) and type(got) is tuple, where
    elif isinstance(ref, (list, tuple)):
        assert type(got) is type(ref) and len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert_tree(a, b, f"{where}[{i}]")
    elif isinstance(ref, argparse.Namespace):
        assert isinstance(got, argparse.Namespace), where
        assert_tree(vars(got), vars(ref), where)
    elif isinstance(ref, torch.dtype):
        assert isinstance(got, TorchDtype) and repr(got) == str(ref), where
    elif isinstance(ref, torch.device):
        assert got == str(ref), where
    elif isinstance(ref, np.ndarray):
        assert type(got) is np.ndarray and got.dtype == ref.dtype and np.array_equal(got, ref), (
            where
        )
    elif isinstance(ref, np.generic):
        assert type(got) is type(ref) and got == ref, where
    else:
        assert got == ref and type(got) is type(ref), where


def random_tensor(dtype: torch.dtype, shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def torch_load(path):
    return torch.load(path, weights_only=False, map_location="cpu")


def rezip(src, dst, *, drop=(), replace=None, deflate=()):
    """Copy a zip entry by entry, dropping, replacing or compressing the entries named."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            name = info.filename
            if any(name.endswith(d) for d in drop):
                continue
            data = next((v for k, v in replace.items() if name.endswith(k)), zin.read(name))
            method = (
                zipfile.ZIP_DEFLATED
                if any(name.endswith(d) for d in deflate)
                else zipfile.ZIP_STORED
            )
            zout.writestr(name, data, compress_type=method)


# -- hand-written archives (for malformed input) -----------------------------------------------


class FakeStorage:
    def __init__(self, key, cls, numel):
        self.key, self.cls, self.numel = key, cls, numel


class FakeTensor:
    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, FakeStorage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def write_archive(path, obj, storages: dict[str, bytes], *, folder="archive", byteorder=b"little"):
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{folder}/data.pkl", buf.getvalue())
        if byteorder is not None:
            z.writestr(f"{folder}/byteorder", byteorder)
        for key, data in storages.items():
            z.writestr(f"{folder}/data/{key}", data)
        z.writestr(f"{folder}/version", b"3\n")


@pytest.fixture(autouse=True)
def _close_fds():
    yield
    close_all()  # tests rewrite files under the same names


# -- every dtype -------------------------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_every_dtype_bit_exact(tmp_path, legacy):
    tensors = {str(d): random_tensor(d, (3, 5), seed=i) for i, d in enumerate(NP_OF)}
    if legacy:  # the legacy format predates these dtypes
        for d in (torch.uint16, torch.float8_e4m3fn, torch.float8_e5m2):
            tensors.pop(str(d))
    path = tmp_path / "dtypes.pt"
    torch.save(tensors, path, _use_new_zipfile_serialization=not legacy)
    assert torch_save.is_torch_zip(path) is not legacy
    assert torch_save.is_torch_legacy(path) is legacy
    got = torch_save.load(path)
    assert_tree(got, torch_load(path))
    # the test can fail: a byte flipped in one storage shows up
    assert not np.array_equal(
        our_bits(got["torch.float32"].read()), bits(tensors["torch.float64"]).astype(np.float32)
    )


def test_zero_d_and_empty_tensors(tmp_path):
    obj = {
        "scalar": torch.tensor(3.25),
        "scalar_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(2, 0, 3, dtype=torch.float16),
        "extra_state": torch.empty(0, dtype=torch.uint8),
    }
    path = tmp_path / "small.pt"
    torch.save(obj, path)
    got = torch_save.load(path)
    assert_tree(got, torch_load(path))
    assert got["scalar"].shape == () and float(got["scalar"].read()) == 3.25


# -- views and shared storages -----------------------------------------------------------------


def _views():
    base = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    return base, {
        "base": base,
        "narrow": base.narrow(1, 2, 3),
        "transpose": base.transpose(0, 2),
        "t": base[1].t(),
        "permute": base.permute(2, 0, 1),
        "expand": base[:, :1, :].expand(4, 6, 5),
        "broadcast_row": base[0, 0].expand(3, 5),
        "step": base[::2, 1::3],
        "step_t": base[1:, ::2, 3].t(),
        "narrow_t": base[1:3, :, 2:4].transpose(0, 1),
        "select": base[2],
        "unsqueezed": base[1, 2:4].unsqueeze(0).unsqueeze(-1),
        "offset_1d": base.reshape(-1)[7:19],
    }


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_views_share_one_storage(tmp_path, legacy):
    base, views = _views()
    path = tmp_path / "views.pt"
    torch.save(views, path, _use_new_zipfile_serialization=not legacy)
    if not legacy:
        with zipfile.ZipFile(path) as z:
            assert sum("/data/" in n for n in z.namelist()) == 1  # one storage for all views
    got = torch_save.load(path)
    assert_tree(got, torch_load(path))
    # strided views are not C-contiguous copies: the layout really differs
    assert not views["transpose"].is_contiguous() and not views["step"].is_contiguous()
    # every sub-box of every view reads the right values
    rng = random.Random(0)
    for name, ref in views.items():
        ref_np = ref.numpy()
        for _ in range(5):
            box = []
            for n in ref.shape:
                a = rng.randrange(n + 1)
                box.append(slice(a, rng.randrange(a, n + 1)))
            np.testing.assert_array_equal(
                got[name].read(tuple(box)), ref_np[tuple(box)], err_msg=name
            )


def test_tensors_with_the_same_key_view_the_same_bytes(tmp_path):
    w = torch.randn(8, 4)
    path = tmp_path / "tied.pt"
    torch.save({"embed": w, "head": w, "head_t": w.t(), "half": w[4:]}, path)
    got = torch_save.load(path)
    assert got["embed"].read().tobytes() == got["head"].read().tobytes() == bits(w).tobytes()
    np.testing.assert_array_equal(got["head_t"].read(), bits(w).T)
    np.testing.assert_array_equal(got["half"].read(), bits(w)[4:])


# -- python objects inside the pickle --------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_nested_python_objects(tmp_path, protocol):
    obj = {
        "args": argparse.Namespace(
            hidden_size=64, params_dtype=torch.bfloat16, lr=1e-4, seq=[1, 2]
        ),
        "model": collections.OrderedDict(
            [("w", torch.randn(3, 2)), ("b", torch.zeros(3, dtype=torch.float16))]
        ),
        "optimizer": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(3, 2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}],
        },
        "rng": {"np": np.random.RandomState(0).get_state(), "torch": torch.get_rng_state()},
        "np_array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_scalar": np.float64(2.5),
        "size": torch.Size([4, 5]),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "key_tuple": {(torch.float32, torch.float32): [torch.ones(2)]},
        "misc": [None, True, "text", b"raw", 3, 4.5, {1, 2}],
        "checkpoint_version": 3.0,
    }
    path = tmp_path / "nested.pt"
    torch.save(obj, path, pickle_protocol=protocol)
    got = torch_save.load(path)
    ref = torch_load(path)
    ref["key_tuple"] = {
        tuple(TORCH_DTYPES[str(d)[6:]] for d in k): v for k, v in ref["key_tuple"].items()
    }
    assert_tree(got, ref)
    assert got["args"].params_dtype.numpy == np.dtype(ml_dtypes.bfloat16)


def test_parameters_and_tensor_attributes(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 4))
    q = torch.nn.Parameter(torch.randn(2))
    q.tag = "with-state"  # pickled through _rebuild_parameter_with_state
    t = torch.randn(5)
    t.note = 1  # pickled through torch._tensor._rebuild_from_type_v2
    frozen = torch.nn.Parameter(torch.randn(2, 2), requires_grad=False)
    path = tmp_path / "params.pt"
    torch.save({"p": p, "q": q, "t": t, "frozen": frozen}, path)
    raw = zipfile.ZipFile(path).read("params/data.pkl")
    for fn in (b"_rebuild_parameter_with_state", b"_rebuild_from_type_v2", b"_rebuild_parameter\n"):
        assert fn in raw
    got = torch_save.load(path)
    assert_tree(got, torch_load(path))


def test_module_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model.to(torch.bfloat16)
    path = tmp_path / "sd.pt"
    torch.save(model.state_dict(), path)  # an OrderedDict carrying `_metadata`
    got = torch_save.load(path)
    ref = torch_load(path)
    assert_tree(got, ref)
    assert got._metadata == ref._metadata


def test_frameworks_are_stubbed(tmp_path, monkeypatch):
    import signal

    obj = {"args": argparse.Namespace(exit_signal=signal.SIGTERM), "w": torch.ones(2)}
    path = tmp_path / "sig.pt"
    torch.save(obj, path)
    got = torch_save.load(path)
    assert is_stub(got["args"].exit_signal, "signal.Signals")
    assert got["args"].exit_signal.stub_args == (15,)
    # policy_extra adds names: allow Signals as a real class instead of stubbing it
    extra = Policy({("signal", "Signals"): signal.Signals})
    assert torch_save.load(path, policy_extra=extra)["args"].exit_signal is signal.SIGTERM


# -- embedded archives -------------------------------------------------------------------------


def test_archive_embedded_at_an_offset(tmp_path):
    obj = {"w": torch.randn(6, 3), "v": torch.arange(10, dtype=torch.int32)[2::2]}
    buf = io.BytesIO()
    torch.save(obj, buf)
    archive = buf.getvalue()
    prefix, suffix = b"\x01" * 1000 + b"PK\x05\x06junk", b"PK\x03\x04" + b"\x02" * 777
    path = tmp_path / "chunks.bin"
    path.write_bytes(prefix + archive + suffix)
    got = torch_save.load(path, base_offset=len(prefix), length=len(archive))
    assert_tree(got, obj)
    # offsets inside the tensors are absolute offsets of the outer file
    with count_reads() as c:
        got["w"].read()
    assert c[str(path)] == 6 * 3 * 4
    assert torch_save.is_torch_zip(path, base_offset=len(prefix), length=len(archive))
    assert not torch_save.is_torch_zip(path)
    with pytest.raises(FormatError, match="chunks.bin"):
        torch_save.load(path, base_offset=len(prefix) + 1, length=len(archive))
    with pytest.raises(FormatError, match="outside the file"):
        torch_save.load(path, base_offset=len(prefix), length=len(archive) + len(suffix) + 1)


def test_real_dcp_chunks(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {
        "w": torch.randn(5, 4),
        "emb": torch.randn(7, 3).to(torch.bfloat16),
        "step": torch.tensor(11.0),
    }
    with pytest.warns(UserWarning):
        dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        md = pickle.load(f)  # torch's own reading, to know where chunks are
    seen = set()
    for index, info in md.storage_data.items():
        got = torch_save.load(
            tmp_path / "ckpt" / info.relative_path, base_offset=info.offset, length=info.length
        )
        assert_tensor(got, sd[index.fqn], index.fqn)
        seen.add(index.fqn)
    assert seen == set(sd)


# -- lazy reading ------------------------------------------------------------------------------


def test_reads_only_the_bytes_asked_for(tmp_path):
    big = torch.randn(1024, 1024)  # 4 MiB
    small = torch.arange(10, dtype=torch.float32)
    path = tmp_path / "big.pt"
    torch.save({"big": big, "small": small, "meta": {"iteration": 3}}, path)
    size = path.stat().st_size
    with count_reads() as c:
        got = torch_save.load(path)
    header_bytes = c[str(path)]
    pkl = len(zipfile.ZipFile(path).read("big/data.pkl"))
    assert pkl < header_bytes < pkl + 4096, (
        header_bytes
    )  # data.pkl, the zip directory, local headers
    assert header_bytes < size // 100
    with count_reads() as c:
        np.testing.assert_array_equal(got["small"].read(), small.numpy())
    assert c[str(path)] == 40 and c[(str(path), "calls")] == 1
    with count_reads() as c:
        rows = got["big"].read((slice(100, 110), slice(None)))
    np.testing.assert_array_equal(rows, big[100:110].numpy())
    assert c[str(path)] == 10 * 1024 * 4 and c[(str(path), "calls")] == 1
    with count_reads() as c:
        cols = got["big"].read((slice(0, 4), slice(8, 16)))
    np.testing.assert_array_equal(cols, big[:4, 8:16].numpy())
    assert c[str(path)] == 4 * 8 * 4


# -- bad input ---------------------------------------------------------------------------------


def _saved(tmp_path, obj=None, name="good.pt"):
    path = tmp_path / name
    torch.save(obj if obj is not None else {"w": torch.randn(4, 4), "b": torch.ones(4)}, path)
    return path


def test_missing_data_pkl(tmp_path):
    bad = tmp_path / "nopkl.pt"
    rezip(_saved(tmp_path), bad, drop=("data.pkl",))
    with pytest.raises(FormatError, match=r"nopkl\.pt.*data\.pkl"):
        torch_save.load(bad)
    assert not torch_save.is_torch_zip(bad)


def test_corrupted_data_pkl_fails_its_crc(tmp_path):
    good = _saved(tmp_path, {"w": torch.ones(3), "device": "cpu-marker"})
    data = good.read_bytes()
    assert data.count(b"cpu-marker") == 1
    bad = tmp_path / "crc.pt"
    bad.write_bytes(data.replace(b"cpu-marker", b"cpu-market"))
    with pytest.raises(FormatError, match=r"crc\.pt: entry 'good/data\.pkl' fails its CRC check"):
        torch_save.load(bad)


def test_missing_storage_entry(tmp_path):
    bad = tmp_path / "nokey.pt"
    rezip(_saved(tmp_path), bad, drop=("/data/1",))
    with pytest.raises(FormatError, match=r"nokey\.pt.*storage '1'.*good/data/1"):
        torch_save.load(bad)


@pytest.mark.parametrize("entry", ["/data.pkl", "/data/0", "/byteorder"])
def test_compressed_entries(tmp_path, entry):
    good = _saved(tmp_path)
    stored = tmp_path / "stored.pt"
    rezip(good, stored)  # the copy itself is fine
    assert_tree(torch_save.load(stored), torch_load(good))
    bad = tmp_path / "deflated.pt"
    rezip(good, bad, deflate=(entry,))
    with pytest.raises(FormatError, match=rf"deflated\.pt: entry 'good{entry}' is compressed"):
        torch_save.load(bad)


def test_big_endian_files(tmp_path):
    bad = tmp_path / "big_endian.pt"
    rezip(_saved(tmp_path), bad, replace={"/byteorder": b"big"})
    with pytest.raises(FormatError, match=r"big_endian\.pt.*little-endian"):
        torch_save.load(bad)


@pytest.mark.parametrize("cut", [1, 22, 200, 0.5])
def test_truncated_files(tmp_path, cut):
    good = _saved(tmp_path)
    data = good.read_bytes()
    n = int(len(data) * cut) if isinstance(cut, float) else len(data) - cut
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[:n])
    with pytest.raises(FormatError, match=r"truncated\.pt"):
        torch_save.load(bad)


def test_view_outside_its_storage(tmp_path):
    st = FakeStorage("0", torch.FloatStorage, 6)
    path = tmp_path / "outside.pt"
    write_archive(
        path,
        {"ok": FakeTensor(st, 0, (2, 3), (3, 1)), "bad": FakeTensor(st, 2, (2, 3), (3, 1))},
        {"0": np.arange(6, dtype=np.float32).tobytes()},
    )
    with pytest.raises(FormatError, match=r"outside\.pt:data/0.*storage has 6"):
        torch_save.load(path)
    write_archive(
        path,
        {"ok": FakeTensor(st, 0, (2, 3), (3, 1))},
        {"0": np.arange(6, dtype=np.float32).tobytes()},
    )
    close_all()
    got = torch_save.load(path)  # the same archive with only the good view is fine
    np.testing.assert_array_equal(got["ok"].read(), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_pickle_cannot_move_a_storage(tmp_path):
    # BUILD on the storage object after it was checked against its entry
    path = tmp_path / "move.pt"
    write_archive(
        path,
        {"w": FakeTensor(FakeStorage("0", torch.FloatStorage, 2), 0, (2,), (1,))},
        {"0": b"\0" * 8},
    )
    with zipfile.ZipFile(path) as z:
        pkl = z.read("archive/data.pkl")
    assert pkl.count(b"Q") == 1  # one BINPERSID
    evil = pkl.replace(b"Q", b"QN}X\x06\x00\x00\x00offsetK\x00s\x86b", 1)
    rezip(path, tmp_path / "moved.pt", replace={"data.pkl": evil})
    with pytest.raises(UnsafePickleError, match=r"moved\.pt.*storage"):
        torch_save.load(tmp_path / "moved.pt")


def test_storage_larger_than_its_entry(tmp_path):
    path = tmp_path / "short_entry.pt"
    st = FakeStorage("7", torch.FloatStorage, 10)
    write_archive(
        path, {"w": FakeTensor(st, 0, (10,), (1,))}, {"7": b"\x00" * 36}, folder="weird name"
    )
    with pytest.raises(FormatError, match=r"short_entry\.pt:data/7.*40 bytes.*36"):
        torch_save.load(path)


def test_any_top_folder_name_and_no_byteorder(tmp_path):
    path = tmp_path / "folder.pt"
    st = FakeStorage("k", torch.HalfStorage, 4)
    data = np.array([1, 2, 3, 4], np.float16)
    write_archive(
        path,
        {"w": FakeTensor(st, 1, (3,), (1,))},
        {"k": data.tobytes()},
        folder="my model",
        byteorder=None,
    )
    np.testing.assert_array_equal(torch_save.load(path)["w"].read(), data[1:])


def test_conjugate_views_are_refused(tmp_path):
    path = tmp_path / "conj.pt"
    torch.save({"c": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()}, path)
    with pytest.raises(FormatError, match=r"conj\.pt.*conj"):
        torch_save.load(path)


def test_malicious_data_pkl_is_refused(tmp_path):
    import os

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil()}, path)
    with pytest.raises(UnsafePickleError, match=r"evil\.pt.*posix\.system"):
        torch_save.load(path)
    assert not marker.exists()
    # a persistent id that is not a storage
    with zipfile.ZipFile(path) as z:
        pkl = z.read("evil/data.pkl")
    assert b"storage" in pkl


def test_not_a_torch_file(tmp_path):
    path = tmp_path / "noise.bin"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(FormatError, match=r"noise\.bin.*neither"):
        torch_save.load(path)
    assert not torch_save.is_torch_zip(path) and not torch_save.is_torch_legacy(path)
    plain = tmp_path / "plain.zip"
    with zipfile.ZipFile(plain, "w") as z:
        z.writestr("a/b.txt", b"hi")
    assert not torch_save.is_torch_zip(plain)
    with pytest.raises(FormatError, match=r"plain\.zip.*data\.pkl"):
        torch_save.load(plain)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_fuzzed_files_only_raise_project_errors(tmp_path, legacy):
    good = _saved(
        tmp_path, {"w": torch.randn(3, 4), "n": argparse.Namespace(a=1), "s": torch.arange(5)[1:]}
    )
    torch.save(torch_load(good), good, _use_new_zipfile_serialization=not legacy)
    data = good.read_bytes()
    rng = random.Random(7)
    path = tmp_path / "fuzz.pt"
    for i in range(120):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        if i % 4 == 0:
            buf = buf[: rng.randrange(len(buf))]
        close_all()
        path.write_bytes(bytes(buf))
        try:
            out = torch_save.load(path)
            for v in out.values() if isinstance(out, dict) else ():
                if isinstance(v, LazyTensor):
                    v.read()
        except HybridCkptError as e:
            assert "fuzz.pt" in str(e)
