"""Export of our Orbax store: raw chunks in C order are copied file to file (a file per chunk for a
raw import; byte ranges found through the OCDBT index otherwise), compressed ones are streamed, and large tensors are read and
written in blocks of rows; every path writes the same bytes."""

import os

import pytest
from meshes import fit
from safetensors.numpy import load_file

from hybridckpt import jobs
from hybridckpt.containers import safetensors_file
from hybridckpt.demo import sample_path
from hybridckpt.io.sequential_file import SequentialFile
from hybridckpt.lazy import parallel

BIG = {f"model.layers.{i}.mlp.up_proj.weight": (256, 128) for i in range(3)}  # 128 KiB fp32 each


@pytest.fixture(scope="module")
def plain_source(tmp_path_factory):
    """A checkpoint of no known model, saved by torch's `dcp.save(no_dist=True)`: three 128 KiB
    tensors and a small one (name -> numpy array)."""
    import torch
    import torch.distributed.checkpoint as dcp

    out = str(tmp_path_factory.mktemp("plain") / "dcp")
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(*s, generator=g) * 0.02 for k, s in BIG.items()}
    sd["model.norm.weight"] = 1 + 0.01 * torch.randn(64, generator=g)
    dcp.save(sd, checkpoint_id=out, no_dist=True)
    return out, {k: v.numpy() for k, v in sd.items()}


def _copied(monkeypatch) -> list[int]:
    """Bytes of every `SequentialFile.copy_run` call (stored bytes copied as they are, never
    materialised) from now on."""
    calls: list[int] = []
    inner = SequentialFile.copy_run

    def spy(self, source, offset, nbytes, check=None):
        calls.append(nbytes)
        return inner(self, source, offset, nbytes, check)

    monkeypatch.setattr(SequentialFile, "copy_run", spy)
    return calls


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_raw_chunks_are_copied_file_to_file_and_compressed_ones_streamed(plain_source, tmp_path, monkeypatch, codec):
    src, tensors = plain_source
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    jobs.import_checkpoint(src, ckpt, mesh=fit("fsdp=2"), compression=codec)
    calls = _copied(monkeypatch)
    jobs.export_checkpoint(ckpt, out)
    got = load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k
    if codec == "none":  # every tensor's chunks (at most two per tensor, one per fsdp shard),
        # the small ones too: a raw import keeps each chunk in a file of its own
        assert sum(calls) == sum(v.nbytes for v in tensors.values()) and len(calls) <= 2 * len(tensors)
    else:
        assert calls == []


def test_large_tensors_are_read_and_written_in_blocks_of_rows(tmp_path, monkeypatch):
    """With the block size cut to 2 KiB, every HF tensor of the sample (kernels transposed back
    to `[out, in]`) is read in boxes of at most one block and the files are the same bytes."""
    ckpt = str(tmp_path / "ckpt")
    jobs.import_checkpoint(sample_path(), ckpt, mesh=fit("fsdp=2,tp=2,pp=2"))
    whole = str(tmp_path / "whole")
    jobs.export_checkpoint(ckpt, whole, optimizer=True)
    boxes: list[int] = []
    inner = parallel.read_box_parallel

    def spy(t, box=None, out=None):
        arr = inner(t, box, out)
        boxes.append(arr.nbytes)
        return arr

    monkeypatch.setattr(parallel, "read_box_parallel", spy)
    monkeypatch.setattr(safetensors_file, "WRITE_BLOCK_BYTES", 2048)
    blocks = str(tmp_path / "blocks")
    jobs.export_checkpoint(ckpt, blocks, optimizer=True)
    assert boxes and max(boxes) <= 2048 and len(boxes) > 20
    for name in sorted(os.listdir(whole)):
        if name.endswith(".safetensors"):
            with open(os.path.join(whole, name), "rb") as a, open(os.path.join(blocks, name), "rb") as b:
                assert a.read() == b.read(), name
