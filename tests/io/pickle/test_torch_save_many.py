"""`containers.torch_save_many`: `torch.save` of a value holding many tensors, written without
torch, against torch itself.

- the archive is `torch.save`'s byte for byte (torch.save of what torch.load gives back), the
  serialization id included across the record counts where libstdc++'s set rehashes;
- zip64 fields (forced on every record) are read by torch's reader;
- tensors are streamed in blocks (a tensor larger than the block is never read whole) or copied
  file to file, and their values come back bitwise.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch

from hybridckpt.containers import torch_save_many as many
from hybridckpt.errors import FormatError
from hybridckpt.io.sequential_file import SequentialFile
from hybridckpt.lazy import ArrayTensor


def _write(path: str, value_of, name: str = "archive") -> None:
    refs = many.Tensors()
    value = value_of(refs)
    with SequentialFile(path, direct=False) as out:
        many.write_archive(out, value, refs, name=name)


def _resaved(path: str, tmp_path) -> bytes:
    again = os.path.join(tmp_path, "again", os.path.basename(path))
    os.makedirs(os.path.dirname(again), exist_ok=True)
    torch.save(torch.load(path, weights_only=True), again)
    with open(again, "rb") as f:
        return f.read()


# 7 records besides the tensors: the set rehashes at 14, 30, 60, 128 records
@pytest.mark.parametrize("n", [0, 1, 6, 7, 8, 22, 23, 52, 53, 54, 121, 122, 300])
def test_the_archive_is_torch_saves_own(tmp_path, n):
    path = str(tmp_path / "optimizer.pt")
    rng = np.random.default_rng(n)
    arrays = {i: rng.standard_normal((i % 3 + 1, 2)).astype(np.float32) for i in range(n)}
    _write(path, lambda r: {"state": {i: {"step": r.ref(ArrayTensor(np.asarray(3.0, np.float32))),
                                          "exp_avg": r.ref(ArrayTensor(a))} for i, a in arrays.items()},
                            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": list(arrays)}]},
           name="optimizer")
    with open(path, "rb") as f:
        ours = f.read()
    assert ours == _resaved(path, tmp_path)
    back = torch.load(path, weights_only=True)
    assert all(np.array_equal(back["state"][i]["exp_avg"].numpy(), a) for i, a in arrays.items())


def test_every_dtype_0d_and_empty_tensors(tmp_path):
    path = str(tmp_path / "x.pt")
    values = {
        "bf16": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
        "f16": np.linspace(-1, 1, 5, dtype=np.float16),
        "f64": np.asarray(2.5),
        "i64": np.arange(-3, 3, dtype=np.int64),
        "i8": np.asarray([-1, 2], np.int8),
        "u8": np.asarray([255], np.uint8),
        "bool": np.asarray([True, False]),
        "empty": np.zeros((0, 4), np.float32),
    }
    _write(path, lambda r: {k: r.ref(ArrayTensor(v)) for k, v in values.items()}, name="x")
    back = torch.load(path, weights_only=True)
    for k, v in values.items():
        got = back[k].view(torch.int16).numpy().view(ml_dtypes.bfloat16) if k == "bf16" else back[k].numpy()
        assert got.shape == v.shape and got.dtype == v.dtype and np.array_equal(got, v), k
    with open(path, "rb") as f:
        assert f.read() == _resaved(path, tmp_path)


def test_zip64_records_load_in_torch(tmp_path, monkeypatch):
    """Every record and offset past the zip64 threshold (0 here): the zip64 block in the local
    header and the central directory, 24-byte descriptors; torch's reader takes them."""
    monkeypatch.setattr(many, "ZIP64_AT", 0)
    path = str(tmp_path / "big.pt")
    a = np.arange(40, dtype=np.float32).reshape(4, 10)
    _write(path, lambda r: {"a": r.ref(ArrayTensor(a)), "b": [r.ref(ArrayTensor(a[1:] * 2)), 7]})
    back = torch.load(path, weights_only=True)
    assert np.array_equal(back["a"].numpy(), a) and np.array_equal(back["b"][0].numpy(), a[1:] * 2)
    assert back["b"][1] == 7
    import zipfile

    with zipfile.ZipFile(path) as z:  # (Python's reader: every entry's zip64 block, the real offsets)
        infos = z.infolist()
    assert len(infos) == 8 and all(i.extra[:2] == b"\x01\x00" for i in infos)
    # data.pkl: a 30-byte header, its name, the 28-byte zip64 block (sizes, offset), the padding's 4,
    # padded to 64; then the data and a 24-byte descriptor
    head = 64 * -(-(30 + len("archive/data.pkl") + 28 + 4) // 64)
    assert [i.header_offset for i in infos][:2] == [0, head + infos[0].file_size + 24]
    monkeypatch.setattr(many, "ZIP64_AT", many.U32)


class _Counting(ArrayTensor):
    """An array that counts the largest box read from it."""

    largest = 0

    def read_box(self, box):
        out = super().read_box(box)
        _Counting.largest = max(_Counting.largest, out.nbytes)
        return out

    def read_into(self, box, out):
        super().read_into(box, out)
        _Counting.largest = max(_Counting.largest, out.nbytes)


def test_a_tensor_is_streamed_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(many, "WRITE_BLOCK_BYTES", 4096)
    a = np.random.default_rng(0).standard_normal((64, 100)).astype(np.float32)  # 25.6 kB
    path = str(tmp_path / "s.pt")
    _Counting.largest = 0
    _write(path, lambda r: {"a": r.ref(_Counting(a))})
    assert 0 < _Counting.largest <= 4096
    assert np.array_equal(torch.load(path, weights_only=True)["a"].numpy(), a)


def test_a_dtype_torch_has_no_storage_for_is_refused():
    with pytest.raises(FormatError, match="complex64 has no torch storage class"):
        many.Tensors().ref(ArrayTensor(np.zeros(2, np.complex64)))


def test_set_order_is_libstdcxx_iteration_for_a_known_case():
    """Six names in 13 buckets with no two in one bucket iterate in reverse (what
    `torch_save_write` relies on for its single-tensor archives)."""
    names = ["data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0", "version"]
    assert len({many._std_hash(n.encode()) % 13 for n in names}) == 6
    assert many.set_order(names) == names[::-1]
