"""Row (h)'s Megatron-Core torch_dist source (`benchmarks/scale_torch_dist.py`) writes what
megatron-core 0.19.2 writes:

- at the real case's size (tests/real/cases/megatron_core_dense_dp_reshardable: TP 2 x PP 2 x
  DP 2, written by megatron itself) its `.metadata` equals megatron's byte for byte (same save id
  and checkpoint id stated), and the `.distcp` files have megatron's sizes; the comparison fails
  when megatron's distribution of the DP replicas over the DP ranks is not replayed;
- a resized source (the common state's args changed) is read by `hybridckpt inspect` with the
  sizes it states, its optimizer buckets mapped back to every parameter.
"""

import io
import os
import shutil
import sys
from contextlib import redirect_stdout

from torch.distributed.checkpoint import FileSystemReader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import scale_torch_dist as std  # noqa: E402

from hybridckpt.cli import main  # noqa: E402


def _quiet(_s):
    pass


def test_like_real_metadata_is_megatrons(tmp_path):
    real = FileSystemReader(std.REAL).read_metadata().storage_meta
    std.write(str(tmp_path), std.LIKE_REAL, 2, 2, 2, save_id=real.save_id, checkpoint_id=real.checkpoint_id,
              log=_quiet)
    got = tmp_path / "iter_0000001"
    assert (got / ".metadata").read_bytes() == open(os.path.join(std.REAL, ".metadata"), "rb").read()
    assert std.compare(std.describe(std.REAL), std.describe(str(got))) == []
    for r in range(8):
        name = f"__{r}_0.distcp"
        assert os.path.getsize(got / name) == os.path.getsize(os.path.join(std.REAL, name))


def test_compare_sees_a_wrong_distribution(tmp_path, monkeypatch):
    # every DP replica saved by DP rank 0 (no balancing): megatron's files differ
    monkeypatch.setattr(std, "_distribute", lambda ranks, sizes, n: {s: r[0] for s, r in ranks.items()})
    std.write(str(tmp_path), std.LIKE_REAL, 2, 2, 2, log=_quiet)
    bad = std.compare(std.describe(std.REAL), std.describe(str(tmp_path / "iter_0000001")))
    assert any(b.startswith("plans") for b in bad) and any(b.startswith("keys") for b in bad)


def test_resized_source_reads(tmp_path):
    m = dict(std.LIKE_REAL, num_layers=4, hidden_size=32, ffn_hidden_size=48, padded_vocab_size=128,
             vocab_size=120, bf16=True, overlap_grad_reduce=True)
    info = std.write(str(tmp_path), m, 2, 2, 4, holes=True, log=_quiet)
    assert info["ranks"] == 16
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["inspect", str(tmp_path)]) == 0
    text = out.getvalue()
    assert '"num_layers": 4' in text and '"hidden_size": 32' in text and '"intermediate_size": 48' in text
    assert '"dp": 4' in text and '"pp": 2' in text and '"tp": 2' in text
    # every parameter (embedding, 4 x 6 layer params, final norm, output) has its master and moments
    assert '"master_weights": 27' in text and '"params_with_state": 27' in text
    shutil.rmtree(tmp_path, ignore_errors=True)
