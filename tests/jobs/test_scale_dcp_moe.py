"""The DeepSeek V3 EP source's direct writer (`benchmarks/scale_sources_moe.write_fast`, the one
the 512-rank row needs: torch's planner for every rank takes hours there) writes what torch's own
`DefaultSavePlanner` and `FileSystemWriter.finish` write for the same torchtitan run:

- a tiny DeepSeek V3 (torchtitan 0.3's keys: top-level model keys, stacked routed experts, the
  flattened optimizer with 12 param-group byte items a param, one `dataloader.dp_rank_{r}` key
  a rank) on 8 ranks, EP 4 x expert-FSDP 2: `.metadata` and every `.distcp` equal byte for byte;
- the check sees the EP ranks' order (EP rank fastest, as torchtitan's mesh); the per-rank keys
  (each rank's `dp_rank` key its own object, added to `planner_data` last to first) are in it.
"""

import os
import pickle
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import scale_sources_moe  # noqa: E402

TINY = dict(scale_sources_moe.DSV3_671B, dim=16, dense_hidden_dim=24, moe_hidden_dim=8, n_layers=2,
            n_dense_layers=1, n_heads=2, num_experts=8, vocab_size=10, q_lora_rank=8, kv_lora_rank=4,
            qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)


def test_fast_moe_source_is_the_planners(tmp_path):
    got = scale_sources_moe.check(str(tmp_path / "ckpt"), 8, 4, log=lambda s: None, config=TINY)
    assert got == {"ranks": 8, "ep": 4, "files": 9, "identical": True}
    md = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    w1 = md.state_dict_metadata["layers.1.moe.routed_experts.inner_experts.w1_EFD"]
    # 8 experts: EP 4 blocks of 2, each cut again over expert-FSDP 2; rank r = efsdp * 4 + ep
    assert [c.offsets[0] for c in w1.chunks] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert list(md.planner_data)[-7:] == [f"dataloader.dp_rank_{r}" for r in range(6, -1, -1)]
    assert all(f"dataloader.dp_rank_{r}" in md.state_dict_metadata for r in range(8))


def test_check_sees_the_ep_order(tmp_path, monkeypatch):
    monkeypatch.setattr(scale_sources_moe._Layout, "coordinate",  # row-major: efsdp fastest
                        lambda self, r: (r // self.mesh[1], r % self.mesh[1]) if len(self.mesh) == 2 else (r,))
    with pytest.raises(AssertionError, match="differs from the planner path"):
        scale_sources_moe.check(str(tmp_path / "ckpt"), 8, 4, log=lambda s: None, config=TINY)
