"""Megatron-Core torch_dist mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, DeepSeek V3).

Fixtures: tests/fixtures/megatron_dist_moe_writer.py, written by torch's DCP writer as
`megatron.core.dist_checkpointing.save` hands it the experts' ShardedTensors: one key per expert
parameter with prepended (layer, global expert) axes, ep rank `e`'s local expert `j` at
`e * n + j`, or per-expert keys with `singleton_local_shards`; the fully reshardable
distributed optimizer's moments under the same chunking (fully reshardable) or in the chained
[dense, experts] optimizer's buckets (dp_reshardable).
Checks: logits equal transformers' forward (fp32, 1e-4) with experts split over dp;
import -> restore on another mesh -> export gives the weights and moments back bit for bit;
experts placed at another ep rank's offsets move the logits far off. (Forgetting the offsets
altogether cannot be saved: torch's planner refuses the untiled expert axis.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from e2e import assert_same, roundtrip
from fixtures.megatron_dist_moe_writer import write_torch_dist_moe
from fixtures.megatron_moe_writer import make_moe
from meshes import fit

from hybridckpt import jobs, models
from hybridckpt.formats.registry import open_source


@pytest.mark.parametrize(
    "family, experts, singleton, kw",
    [
        ("mixtral", "sequential", False, {}),
        ("mixtral", "te_grouped", True, {}),
        # --moe-router-pre-softmax: softmax over all experts, top-k, no renormalisation
        ("qwen3_moe", "te_grouped", False, dict(norm_topk_prob=False)),
        # MLA, a dense first layer (per-layer keys), shared experts, the expert_bias buffer
        ("deepseek_v3", "te_grouped", False, dict(layers=4)),
    ],
)
def test_logits_equal_transformers(tmp_path, family, experts, singleton, kw):
    ref, model = make_moe(family, seed=9, **kw)
    write_torch_dist_moe(str(tmp_path), ref, tp=2, pp=2, ep=2, experts=experts, singleton=singleton)
    src = open_source(str(tmp_path))
    assert src.config == models.config_from_hf(ref.config)
    stacked = "decoder.layers.mlp.experts.linear_fc1.weight"
    assert any(stacked in n for n in src.notes) is False  # taken apart into per-expert names
    assert "decoder.layers.1.mlp.experts.3.linear_fc1.weight" in src.tensors
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path), tokens, mesh=fit("dp=2,tp=2,pp=2", keep="dp"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "family, optim, experts, dp, layout",
    [
        ("mixtral", "fully_reshardable", "sequential", 2, "megatron-lm"),
        ("mixtral", "dp_reshardable", "sequential", 4, "megatron-lm"),
        ("qwen3_moe", "dp_reshardable", "te_grouped", 2, "megatron-lm"),
        ("deepseek_v3", "dp_reshardable", "sequential", 4, "megatron-lm"),
        # Megatron-Bridge: no args, the MoE / MLA fields from run_config.yaml
        ("deepseek_v3", "dp_reshardable", "te_grouped", 2, "bridge"),
    ],
)
def test_import_restore_export_bitwise_with_moments(tmp_path, family, optim, experts, dp, layout):
    """The distributed optimizer's moments follow their experts: model-space keys
    (fully_reshardable), or the chained [dense, experts] buckets (dp_reshardable, the default),
    whose expert domains are the expert tp-ep-pp ranks."""
    # Qwen3-MoE with dense layers 1 and 3: per-layer keys (a non-homogeneous stack), dense
    # params in the dense optimizer's buckets
    kw = {"qwen3_moe": dict(layers=4, mlp_only_layers=(1, 3)), "deepseek_v3": dict(layers=4)}
    kw = kw.get(family, {})
    pp = ",pp=2" if family != "deepseek_v3" else ""  # its one dense layer: no pp split
    ref, _ = make_moe(family, seed=7, **kw)
    src = str(tmp_path / "dist")
    write_torch_dist_moe(
        src, ref, tp=2, pp=2, ep=2, dp=dp, experts=experts, optim=optim, layout=layout
    )
    opened = open_source(src)
    assert opened.config == models.config_from_hf(ref.config)
    assert any(f"optimizer: distributed optimizer, {optim}" in n for n in opened.notes)
    if layout == "bridge":
        assert "model config from run_config.yaml" in opened.notes
    params, mu, nu, step = roundtrip(
        src, str(tmp_path), mesh_a="dp=2,tp=2" + pp, mesh_b="fsdp=2,tp=4", keep="dp"
    )
    assert_same(params, ref.weights)
    assert_same(mu, _zero_buffers(ref.exp_avg), "exp_avg")
    assert_same(nu, _zero_buffers(ref.exp_avg_sq), "exp_avg_sq")
    assert step == 40


def _zero_buffers(moments: dict) -> dict:
    """The reference moments with the router's bias buffer (DeepSeek V3) at zero."""
    return {
        k: np.zeros_like(v) if k.endswith("e_score_correction_bias") else v
        for k, v in moments.items()
    }


def test_misassigned_ep_offsets_move_the_logits(tmp_path):
    """Ep rank 0's experts at ep rank 1's offsets and back: a valid checkpoint (the expert axis
    tiled) whose experts are permuted against the router: logits far off transformers'."""
    ref, model = make_moe("mixtral", seed=9)
    write_torch_dist_moe(str(tmp_path), ref, tp=2, ep=2, experts="sequential", ep_order=(1, 0))
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path), tokens, mesh=fit("dp=2,tp=2,pp=2", keep="dp"))
    assert np.abs(got - want).max() > 1000 * 1e-4


def test_local_spec_pre_mlp_norm_lies_before_the_router():
    """The local spec's pre-MLP norm is a module of its own, `pre_mlp_layernorm`, registered
    before the MoE layer (router, experts), which torch_dist saves under TE's fused key
    `mlp.linear_fc1.layer_norm_weight` (gpt_layer_specs.py sharded_state_dict_keys_map): in the
    dense optimizer's buckets (reverse `named_parameters()` order) it lies before the router, as
    megatron-core 0.19.2 wrote tests/real/cases/megatron_core_moe_sequential_dp_reshardable.
    Ordered as TE's `linear_fc1` norm, after the router, the two swap their moments and masters."""
    from hybridckpt.formats.megatron.layout import Topology
    from hybridckpt.formats.megatron_dist import buckets

    layer = [
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "mlp.router.weight",
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.experts.0.linear_fc1.weight",
    ]
    model = {f"decoder.layers.0.{s}": None for s in layer}
    topo = Topology(tp=1, pp=1, vpp=1, ep=1, dp=1)
    got = buckets.chunk_params(model, topo, 0, 0, tied=False, local_spec=True, where="x")
    assert [n[len("decoder.layers.0.") :] for n in got] == [
        "self_attention.linear_qkv.layer_norm_weight",  # input_layernorm
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
        "mlp.linear_fc1.layer_norm_weight",  # pre_mlp_layernorm
        "mlp.router.weight",
    ]
    # TE: the norm is linear_fc1's own (a dense layer), after the router if there were one
    te = buckets.layer_order(local_spec=False)
    assert te.index("mlp.linear_fc1.layer_norm_weight") > te.index("mlp.router.weight")
    assert te.index("pre_mlp_layernorm.weight") < te.index("mlp.router.weight")


def test_ep1_experts_lie_in_the_dense_buffer_after_the_router():
    """With expert_model_parallel_size 1 (experts split like the dense layers) megatron-core
    builds one optimizer, unchained, and the routed experts are ordinary params of the dense
    buffers, at their `named_parameters()` place: the MoE layer registers router, experts, shared
    experts (moe_layer.py). SequentialMLP: per expert fc1, fc2; TEGroupedMLP: all fc1, all fc2.
    megatron-core 0.19.2 lays it out so (tests/real/cases/megatron_core_moe_ep1_dp_reshardable)."""
    from hybridckpt.errors import FormatError
    from hybridckpt.formats.megatron_dist.expert_buckets import ExpertLayout, with_inline_experts
    from hybridckpt.lazy import ArrayTensor

    pre = "decoder.layers.3.mlp."
    model = {
        f"{pre}experts.{e}.{fc}.weight": ArrayTensor(np.zeros(s, np.float32))
        for e in range(2)
        for fc, s in (("linear_fc1", (8, 4)), ("linear_fc2", (4, 4)))
    }
    dense = [f"{pre}router.weight", f"{pre}shared_experts.linear_fc1.weight"]
    names, shapes = with_inline_experts(
        model, [3], dense, [(2, 4), (8, 4)], ExpertLayout("sequential", 1, 2, 4), 2, "x"
    )
    assert names == [
        f"{pre}router.weight",
        f"{pre}experts.local_experts.0.linear_fc1.weight",
        f"{pre}experts.local_experts.0.linear_fc2.weight",
        f"{pre}experts.local_experts.1.linear_fc1.weight",
        f"{pre}experts.local_experts.1.linear_fc2.weight",
        f"{pre}shared_experts.linear_fc1.weight",
    ]
    assert shapes[1:3] == [(4, 4), (4, 2)]  # tp 2: fc1 rows, fc2 columns halved
    names, _ = with_inline_experts(
        model, [3], dense, [(2, 4), (8, 4)], ExpertLayout("te_grouped", 1, 2, 4), 1, "x"
    )
    assert names[1:5] == [
        f"{pre}experts.linear_fc1.weight0",
        f"{pre}experts.linear_fc1.weight1",
        f"{pre}experts.linear_fc2.weight0",
        f"{pre}experts.linear_fc2.weight1",
    ]
    with pytest.raises(FormatError, match=r"x: layer 3 holds routed experts but no .*router"):
        with_inline_experts(model, [3], [], [], ExpertLayout("sequential", 1, 2, 4), 1, "x")
