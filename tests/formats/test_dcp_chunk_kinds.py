"""DCP chunks of one kind (length, shape, dtype) are parsed once: the others are matched
against the parsed one's bytes outside its elements (`formats.dcp.chunk`), so a plan touching a
million chunks of a few thousand shapes parses a few thousand archives, and keeps 8 bytes a chunk.
Values are bit for bit torch's; a chunk that differs where a load reads is parsed (and refused).

Sources are written by torch DCP in-process (one chunk per tensor, many of one shape).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats import dcp
from hybridckpt.formats.dcp import chunk

SHAPES = {"a": (6, 5), "b": (3,)}  # 24 tensors of each: 48 chunks, 2 kinds


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import torch
    import torch.distributed.checkpoint as tdcp

    out = tmp_path_factory.mktemp("kinds")
    g = torch.Generator().manual_seed(7)
    sd = {f"{k}{i}": torch.randn(*s, generator=g) for k, s in SHAPES.items() for i in range(24)}
    tdcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
    return str(out), {k: v.numpy() for k, v in sd.items()}


@pytest.fixture
def parses(monkeypatch):
    """Full parses of a torch.save archive (calls of `torch_save.load`), from a clean slate."""
    monkeypatch.setattr(chunk, "_TEMPLATES", type(getattr(chunk, "_TEMPLATES", {}))(), raising=False)
    calls = []
    real = torch_save.load

    def load(*a, **k):
        calls.append(k.get("base_offset"))
        return real(*a, **k)

    monkeypatch.setattr(torch_save, "load", load)
    return calls


def test_one_parse_per_kind_values_exact(saved, parses):
    path, ref = saved
    src = dcp.open(path)
    for k, want in ref.items():
        got = src.tensors[k].materialize()
        assert np.array_equal(got, want), k
    assert len(parses) == len(SHAPES)  # not one per chunk (48)


def _copy_with(saved, tmp_path, fqn, old: bytes, new: bytes) -> str:
    """A copy of the source whose chunk of `fqn` has `old` replaced by `new` (same length)."""
    path = str(tmp_path / "copy")
    shutil.copytree(saved[0], path)
    (c,) = read_metadata(path).tensors[fqn].chunks
    with open(c.path, "r+b") as f:
        f.seek(c.offset)
        blob = f.read(c.length)
        assert blob.count(old) == 1
        f.seek(c.offset + blob.index(old))
        f.write(new)
    return path


def test_a_chunk_differing_where_a_load_reads_is_parsed_and_refused(saved, parses, tmp_path):
    path = _copy_with(saved, tmp_path, "model.a5", b"little", b"LITTLE")
    src = dcp.open(path)
    assert np.array_equal(src.tensors["a0"].materialize(), saved[1]["a0"])
    with pytest.raises(FormatError, match="byteorder"):
        src.tensors["a5"].materialize()
    assert len(parses) == 2  # a0 (the kind's template), then a5 in full


def test_chunks_differing_in_their_serialization_ids_and_crcs_are_matched(saved, parses):
    """torch.save gives every chunk its own `.data/serialization_id` (and so its CRCs): those
    bytes are not compared, the rest is."""
    path, ref = saved
    (a0,), (a1,) = (read_metadata(path).tensors[f"model.a{i}"].chunks for i in (0, 1))
    with open(a0.path, "rb") as f:
        blob = f.read()
    assert blob[a0.offset : a0.offset + a0.length] != blob[a1.offset : a1.offset + a1.length]
    src = dcp.open(path)
    for k in ("a0", "a1", "a2"):
        assert np.array_equal(src.tensors[k].materialize(), ref[k])
    assert len(parses) == 1
