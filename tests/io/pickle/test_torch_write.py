"""What we write for torch without torch, against what torch itself writes and loads.

- `emit.dumps` is CPython's pickler byte for byte (memo, batches of 1000, 64 KiB frames);
- `torch_save_write` archives are `torch.save`'s byte for byte (every dtype we write, 0-d and
  empty tensors, plain values), the serialization id included;
- a DCP folder written by `formats.dcp.write_files` from the tensors of a torch state dict is the
  folder `dcp.save` writes: the `.distcp` bytes identical, the `.metadata` objects equal (the
  pickle differs only in which equal strings share a memo slot), and torch loads it.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import warnings
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.containers.pickle import emit, torch_save
from hybridckpt.containers.pickle.machine import safe_loads
from hybridckpt.containers.pickle.torch_policy import TORCH_POLICY
from hybridckpt.containers.torch_save_write import TensorArchive, object_archive
from hybridckpt.errors import FormatError
from hybridckpt.formats.dcp.write_files import Item, row_blocks, write_folder
from hybridckpt.lazy import ArrayTensor

# -- emit ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 999, 1000, 3000])
def test_emit_is_cpythons_pickler(protocol, n):
    values = [
        {f"k{i}": [float(i)] * 10 for i in range(n)},
        [f"x{i}" for i in range(n)],
        {
            f"k{i}": (i, "a" * (i % 300), [i] * 3, (1.0, 2.0), None, True, -(2**40))
            for i in range(n)
        },
    ]
    for v in values:
        assert emit.dumps(v, protocol) == pickle.dumps(v, protocol=protocol)
    long = {"a": "x" * 70000, "b": ["y" * 100000, 1.0]}  # written outside frames
    assert emit.dumps(long, protocol) == pickle.dumps(long, protocol=protocol)


def test_emit_objects_are_the_classes_pickles():
    ns = argparse.Namespace(a=1, b="x", c=[1.5])
    desc = emit.Obj(emit.Global("argparse", "Namespace"), {"a": 1, "b": "x", "c": [1.5]})
    for protocol in (2, 4):
        assert emit.dumps(desc, protocol) == pickle.dumps(ns, protocol=protocol)
    size = emit.Reduce(emit.Global("torch", "Size"), ((2, 3),))
    assert pickle.loads(emit.dumps(size)) == torch.Size([2, 3])
    assert pickle.loads(emit.dumps(emit.Global("torch", "bfloat16"))) is torch.bfloat16
    got = safe_loads(emit.dumps([size, emit.Global("torch", "float32")]), TORCH_POLICY, what="t")
    assert got[0] == (2, 3) and repr(got[1]) == "torch.float32"


# -- torch.save archives ---------------------------------------------------------------------------


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _ours(arr: np.ndarray) -> bytes:
    a = TensorArchive(arr.shape, arr.dtype)
    data = np.ascontiguousarray(arr).tobytes()
    out = a.head + data + a.tail(zlib.crc32(data))
    assert len(out) == a.length
    return out


def _torch_save(x) -> bytes:
    b = io.BytesIO()
    torch.save(x, b)
    return b.getvalue()


TENSORS = [
    lambda: torch.arange(6, dtype=torch.float32).reshape(2, 3),
    lambda: torch.tensor(3.0),  # AdamW's step: 0-d float32
    lambda: torch.randn(5, 7, 3).bfloat16(),
    lambda: torch.zeros(0, 4),  # empty: a record with no data descriptor
    lambda: torch.arange(1000, dtype=torch.int64),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.randn(300, 17).half(),
    lambda: torch.randn(3, 3, dtype=torch.float64),
    lambda: torch.arange(-5, 5, dtype=torch.int8),
    lambda: torch.arange(7, dtype=torch.int32),
]


@pytest.mark.parametrize("make", TENSORS)
def test_tensor_archive_is_torch_save(make):
    t = make()
    ours = _ours(_numpy(t))
    assert ours == _torch_save(t)
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back.dtype == t.dtype and torch.equal(back, t)


@pytest.mark.parametrize("value", [0.01, (0.9, 0.95), ["a", "b"], None, True, 3, {"x": 1}, "s"])
def test_object_archive_is_torch_save(value):
    assert object_archive(value) == _torch_save(value)
    assert torch.load(io.BytesIO(object_archive(value)), weights_only=True) == value


def test_archive_read_by_our_reader(tmp_path):
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    path = tmp_path / "chunk"
    path.write_bytes(b"x" * 7 + _ours(arr))
    t = torch_save.load(str(path), base_offset=7, length=path.stat().st_size - 7)
    assert np.array_equal(t.materialize(), arr)


def test_archive_refuses_what_torch_cannot_hold():
    with pytest.raises(FormatError, match="storage class"):
        TensorArchive((2,), np.uint16)
    with pytest.raises(FormatError, match="split the tensor"):
        TensorArchive((2**31,), np.float32)


# -- a DCP folder ----------------------------------------------------------------------------------


def _state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 5))
    o = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(4, 3)).sum().backward()
    o.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return m, o, *get_state_dict(m, o)


def _items(msd, osd) -> list[Item]:
    items = [Item(("model", k), tensor=ArrayTensor(v.numpy())) for k, v in msd.items()]
    for k, st in osd["state"].items():
        items += [
            Item(("optim", "state", k, s), tensor=ArrayTensor(v.numpy())) for s, v in st.items()
        ]
    for i, g in enumerate(osd["param_groups"]):
        items += [Item(("optim", "param_groups", i, k), value=v) for k, v in g.items()]
    return items


def test_dcp_folder_is_what_dcp_save_writes(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m, o, msd, osd = _state()
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(theirs), no_dist=True)
    ours.mkdir()
    files = write_folder(str(ours), _items(msd, osd), checkpoint_id=str(theirs), direct_io=False)
    assert files == ["__0_0.distcp", ".metadata"]
    assert (ours / "__0_0.distcp").read_bytes() == (theirs / "__0_0.distcp").read_bytes()
    a = pickle.loads((theirs / ".metadata").read_bytes())
    b = pickle.loads((ours / ".metadata").read_bytes())
    assert b.storage_meta.save_id != a.storage_meta.save_id  # (a fresh uuid, as torch's)
    b.storage_meta.save_id = a.storage_meta.save_id
    assert a == b
    assert list(a.storage_data) == list(b.storage_data)  # written in the same order
    assert [k.index for k in a.storage_data] == [k.index for k in b.storage_data]  # (not in eq)
    # torch loads it into another model and optimizer
    m2 = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 5))
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    msd2, osd2 = get_state_dict(m2, o2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(ours), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=msd2, optim_state_dict=osd2)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters(), strict=True))
    assert o2.param_groups[0]["lr"] == 0.01
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o.state[p][slot], o2.state[q][slot])


def test_dcp_row_blocks_and_several_files(tmp_path):
    """Chunks as row blocks over several writer files: torch reassembles them, and so do we."""
    import torch.distributed.checkpoint as dcp

    g = np.random.default_rng(0)
    w = g.standard_normal((37, 8)).astype(np.float32)
    b16 = g.standard_normal((9, 3)).astype(ml_dtypes.bfloat16)
    assert len(row_blocks((37, 8), 4, 5 * 32)) == 8  # 5 rows of 32 bytes a block: 8 blocks
    items = [Item(("model", "w"), ArrayTensor(w)), Item(("model", "h"), ArrayTensor(b16)),
             Item(("extra", "n"), value=[1, "two"])]  # fmt: skip
    write_folder(str(tmp_path), items, files=3, max_chunk_bytes=5 * 32, direct_io=False)
    assert sorted(os.listdir(tmp_path)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]
    md = read_metadata(str(tmp_path))
    assert [c.sizes[0] for c in sorted(md.tensors["model.w"].chunks, key=lambda c: c.offsets)] == [
        5
    ] * 7 + [2]
    sd = {
        "model": {"w": torch.zeros(37, 8), "h": torch.zeros(9, 3, dtype=torch.bfloat16)},
        "extra": {"n": None},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path), no_dist=True)
    assert np.array_equal(sd["model"]["w"].numpy(), w)
    assert np.array_equal(_numpy(sd["model"]["h"]), b16)
    assert sd["extra"]["n"] == [1, "two"]
