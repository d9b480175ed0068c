"""Row (h)'s fast DCP source (`benchmarks/scale_dcp.py`) writes what torch writes:

- its `.metadata` equals, byte for byte, the one torch's own `DefaultSavePlanner` (every rank)
  and `FileSystemWriter.finish` write for the same run (1, 3 and 16 ranks of a small Llama, the
  16-rank one with empty shards that the planner deduplicates), and its `.distcp` files are
  equal too; the check fails when the object sharing across ranks is wrong (a string shared by
  all ranks, as no gather would leave it, changes the pickle);
- its data writer writes each item as torch's `FileSystemWriter._write_item` does: a DCP
  `dcp.save` by torch of the same values gives the same file and the same (offset, length)s.
"""

import os
import pickle
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import scale_dcp  # noqa: E402
import scale_sources  # noqa: E402

SMALL = dict(scale_sources.LLAMA_405B, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=10)


@pytest.mark.parametrize("world", [1, 3, 16])
def test_fast_metadata_is_the_planners(tmp_path, world):
    got = scale_dcp.check(str(tmp_path / "ckpt"), world, params=scale_sources.llama_params(SMALL), log=lambda s: None)
    assert got["identical"] and got["files"] == world + 1
    md = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    emb = md.state_dict_metadata["model.model.embed_tokens.weight"]
    # 10 rows over 16 ranks: torch.chunk gives 10 rows of 1, the 6 empty shards are one chunk
    assert len(emb.chunks) == (min(world, 10) + (1 if world > 10 else 0))


def test_check_sees_sharing_across_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(scale_dcp, "fresh", lambda s: s)  # every rank's string one object
    with pytest.raises(AssertionError, match="differs from the planner path"):
        scale_dcp.check(str(tmp_path / "ckpt"), 3, params=scale_sources.llama_params(SMALL), log=lambda s: None)


def test_data_writer_is_torchs(tmp_path):
    import torch.distributed.checkpoint as dcp

    values = {"lr": 3e-4, "names": ["x", "y"], "a": torch.zeros(5, 7), "b": torch.zeros(0, 3),
              "step": torch.tensor(1000.0), "c": torch.zeros(300, dtype=torch.bfloat16),
              "big": torch.zeros(3000, 700)}
    theirs = tmp_path / "torch"
    with pytest.warns(UserWarning):  # no process group: one process, as no_dist says
        dcp.save(values, checkpoint_id=str(theirs), no_dist=True)
    md = pickle.loads((theirs / ".metadata").read_bytes())
    spans = sorted((v.offset, v.length, k.fqn) for k, v in md.storage_data.items())
    pieces = []
    for _, _, fqn in spans:
        v = values[fqn]
        if isinstance(v, torch.Tensor) and not v.any():
            pieces.append((*scale_dcp.zeros_archive(tuple(v.shape), v.dtype), True))
        else:
            pieces.append((*scale_dcp.saved(v), False))
    ours = tmp_path / "ours.distcp"
    assert scale_dcp.write_rank_file(str(ours), pieces) == [(at, n) for at, n, _ in spans]
    with open(theirs / "__0_0.distcp", "rb") as a, open(ours, "rb") as b:
        assert scale_dcp._digest(a) == scale_dcp._digest(b)
    assert (theirs / "__0_0.distcp").read_bytes() == ours.read_bytes()  # holes read as torch's zeros
    # the big zero tensor is a hole: the archive's header and trailer only are written
    assert os.stat(ours).st_blocks * 512 < 3000 * 700 * 4 // 4
    holes = tmp_path / "holes.distcp"
    scale_dcp.write_rank_file(str(holes), pieces, holes=True)
    with open(theirs / "__0_0.distcp", "rb") as a, open(holes, "rb") as b:
        assert scale_dcp._digest(a) != scale_dcp._digest(b)  # the digest sees the missing headers
