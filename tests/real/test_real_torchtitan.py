"""Checkpoints torchtitan 0.3.0 wrote itself (tests/real/generators/torchtitan.py): Llama 3, Qwen3
(tied head) and Qwen3-MoE with expert parallelism, trained 3 steps on gloo CPU ranks and saved by
its CheckpointManager (`ckpt/step-3/`).

Each case: import onto mesh A, restore onto mesh B, export to HF: params and AdamW moments bit for
bit against torchtitan's own HF-named references (its `StateDictAdapter.to_hf`, the moments split
by its own `FusedQKVLinear` hook); the imported model's logits against torchtitan's forward; one
optax AdamW step from the exported state against torchtitan's own next optimizer step (relative
1e-5; a wrong step count fails it).
"""

from __future__ import annotations

import os
import types

import jax
import numpy as np
import pytest
from cases import case_dir, ckpt, manifest, reference
from e2e import assert_same, roundtrip
from fixtures.ckpt_checks import optax_next

from hybridckpt import jobs, lazy
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.formats import dcp
from hybridckpt.formats.model_config import load_config_file
from hybridckpt.formats.registry import detect

CASES = ("torchtitan_llama3", "torchtitan_qwen3", "torchtitan_qwen3_moe")
STEP = 3
# fp32 forward on both sides; the MoE experts run in bfloat16 in torchtitan (GroupedExperts casts
# x and the weights), so its logits carry bf16 rounding of the expert outputs
LOGITS_ATOL = {"torchtitan_llama3": 1e-5, "torchtitan_qwen3": 1e-5, "torchtitan_qwen3_moe": 2e-2}


def _names(ref, kind: str) -> list[str]:
    return sorted(k.split("/", 1)[1] for k in ref if k.startswith(kind + "/"))


def _config(case: str) -> str:
    return os.path.join(case_dir(case), "config.json")


def _meshes() -> tuple[str, str]:
    """Two different meshes over the devices present (a real reshard between them); on one
    device both are dp=1."""
    n = jax.device_count()
    if n >= 8:
        return "fsdp=2,tp=2,pp=2", "dp=2,fsdp=4"
    if n >= 4:
        return "fsdp=2,tp=2", "dp=2,fsdp=2"
    if n >= 2:
        return "fsdp=2", "tp=2"
    return "dp=1", "dp=1"  # one device: the same path, the layout unchanged


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (params, exp_avg, exp_avg_sq, step, orbax folder) after the whole path."""
    out = {}
    mesh_a, mesh_b = _meshes()
    for case in CASES:
        work = str(tmp_path_factory.mktemp(case))
        params, mu, nu, step = roundtrip(
            ckpt(case), work, mesh_a=mesh_a, mesh_b=mesh_b, config=_config(case)
        )
        out[case] = (params, mu, nu, step, os.path.join(work, "orbax"))
    return out


# -- what torchtitan wrote ------------------------------------------------------------------------


def test_the_cases_were_written_by_torchtitan_0_3_0():
    for case in CASES:
        m = manifest(case)
        assert m["tool"] == "torchtitan" and m["versions"]["torchtitan"] == "0.3.0", case
        assert sorted(os.listdir(ckpt(case))) == [f"step-{STEP}"]


def test_layout_model_at_top_level_fused_moments_split_model_tensors():
    """CheckpointManager's flattened state: model fqns at the top level, q/k/v saved split by the
    FusedQKVLinear hook (one whole chunk each: the hook gathers them), moments keyed by the fused
    parameter and FSDP-sharded; trainer states as bytes items."""
    md = read_metadata(ckpt("torchtitan_qwen3", f"step-{STEP}"))
    fused = "layers.0.attention.qkv_linear.wqkv.weight"
    assert not any(k.startswith("model.") for k in md.tensors)
    wq = md.tensors["layers.0.attention.qkv_linear.wq.weight"]
    assert wq.shape == (4 * 8, 32) and len(wq.chunks) == 1
    mu = md.tensors[f"optimizer.state.{fused}.exp_avg"]
    assert mu.shape == ((4 + 2 * 2) * 8, 32) and len(mu.chunks) == 2
    assert (
        f"{fused}" not in md.tensors
        and "optimizer.state.layers.0.attention.qkv_linear.wq.weight.exp_avg" not in md.tensors
    )
    # tied head (Qwen3's small configs): saved twice in the model state, once in the optimizer
    assert (
        "lm_head.weight" in md.tensors
        and "optimizer.state.lm_head.weight.exp_avg" not in md.tensors
    )
    assert {"train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch", "dataloader.world_size",
            f"optimizer.param_groups.{fused}.lr", f"optimizer.param_groups.{fused}.initial_lr"} <= set(md.bytes_items)  # fmt: skip


def test_experts_sharded_on_the_expert_axis_over_ep_and_efsdp():
    """EP 2 x efsdp 2 with 4 experts: torchtitan shards the grouped experts on the EXPERT axis for
    both (`_StridedShard(0)` over efsdp, `Shard(0)` over ep: one expert per rank, chunk order
    0, 2, 1, 3); Shard(1) over efsdp only when efsdp * ep > experts (distributed/fsdp.py)."""
    md = read_metadata(ckpt("torchtitan_qwen3_moe", f"step-{STEP}"))
    w1 = md.tensors["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    assert w1.shape == (4, 16, 32)
    assert sorted(tuple(c.offsets) for c in w1.chunks) == [(e, 0, 0) for e in range(4)]
    assert all(tuple(c.sizes) == (1, 16, 32) for c in w1.chunks)
    mu = md.tensors["optimizer.state.layers.0.moe.routed_experts.inner_experts.w2_EDF.exp_avg"]
    assert sorted(tuple(c.offsets) for c in mu.chunks) == [(e, 0, 0) for e in range(4)]
    bias = md.tensors["layers.0.moe.expert_bias_E"]  # a buffer: whole, no optimizer state
    assert (
        len(bias.chunks) == 1
        and "optimizer.state.layers.0.moe.expert_bias_E.exp_avg" not in md.tensors
    )


def test_manager_folder_trainer_state_and_hyperparameters():
    for case in CASES:
        assert detect(ckpt(case)) == "dcp"
        src = dcp.open(ckpt(case), config=load_config_file(_config(case)))
        assert src.step == src.optimizer.step == STEP
        assert src.trainer["train_state.step"] == STEP == src.trainer["lr_scheduler.last_epoch"]
        assert (
            src.trainer["train_state.ntokens_seen"] == STEP * 16
        )  # one rank's 1 x 16 tokens a step
        h = src.optimizer.hyper
        assert h["betas"] == [0.9, 0.95] and h["eps"] == 1e-8 and h["weight_decay"] == 0.1
        # the scheduler's lr for the NEXT step (warmup 2, then linear decay over 100 steps)
        assert h["lr"] == pytest.approx(1e-2 * (1 - (STEP - 2) / 98), rel=1e-12)
    # without a config (no head counts) the fused moments stay fused, and inspect says so
    info = jobs.inspect(ckpt("torchtitan_llama3"))
    assert info["needs_config"] and info["step"] == STEP
    bare = dcp.open(ckpt("torchtitan_llama3"))
    assert "layers.0.attention.qkv_linear.wqkv.weight" in bare.optimizer.slots["exp_avg"]


# -- the whole path: bitwise, logits, next step ---------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_import_restore_export_bitwise(exported, case):
    params, mu, nu, step, _ = exported[case]
    ref = reference(case)
    assert_same(params, {k: ref[f"param/{k}"] for k in _names(ref, "param")})
    assert_same(mu, {k: ref[f"exp_avg/{k}"] for k in _names(ref, "exp_avg")}, "exp_avg")
    assert_same(nu, {k: ref[f"exp_avg_sq/{k}"] for k in _names(ref, "exp_avg_sq")}, "exp_avg_sq")
    assert step == STEP == int(ref["step"].item())


@pytest.mark.parametrize("case", ["torchtitan_llama3", "torchtitan_qwen3"])
def test_logits_equal_torchtitans_forward(exported, case):
    """The imported model (mesh B) against torchtitan's own forward of the saved model: fp32 on
    both sides, atol 1e-5 (logits of order 1; seen: 1e-6)."""
    ref = reference(case)
    got = jobs.logits(exported[case][4], ref["tokens"], mesh=_meshes()[1])
    assert np.abs(ref["logits"]).max() > 0.5
    np.testing.assert_allclose(got, ref["logits"], atol=LOGITS_ATOL[case], rtol=0)


def test_moe_logits_equal_torchtitans_forward_without_its_expert_bias(exported):
    """HF Qwen3-MoE has no load-balancing bias and torchtitan's own to_hf drops `expert_bias_E`:
    the imported model equals torchtitan's forward with that bias zeroed (atol 2e-2: torchtitan
    runs the experts in bfloat16). With the bias (max |bias| ~3e-3 after 3 steps) torchtitan picks
    other experts for some tokens, and the comparison sees it."""
    case = "torchtitan_qwen3_moe"
    ref = reference(case)
    got = jobs.logits(exported[case][4], ref["tokens_without_expert_bias"], mesh=_meshes()[1])
    np.testing.assert_allclose(
        got, ref["logits_without_expert_bias"], atol=LOGITS_ATOL[case], rtol=0
    )
    assert np.abs(got - ref["logits"]).max() > 5 * LOGITS_ATOL[case]


@pytest.mark.parametrize("case", CASES)
def test_next_optax_step_equals_torchtitans_next_step(exported, case):
    """From the exported params and moments, torchtitan's next-step gradients and the
    hyperparameters read from its param groups: one optax AdamW step equals torchtitan's own
    next optimizer step (fused CPU AdamW) to relative 1e-5; the step count off by one does not."""
    params, mu, nu, step, _ = exported[case]
    ref = reference(case)
    src = dcp.open(ckpt(case), config=load_config_file(_config(case)))
    grads = {k: ref[f"grad/{k}"] for k in _names(ref, "grad")}
    assert sorted(grads) == sorted(params)
    opt = types.SimpleNamespace(
        hyper=src.optimizer.hyper,
        slots={"exp_avg": {k: lazy.ArrayTensor(v) for k, v in mu.items()},
               "exp_avg_sq": {k: lazy.ArrayTensor(v) for k, v in nu.items()}},
    )  # fmt: skip
    p = {k: lazy.ArrayTensor(v) for k, v in params.items()}

    def worst(count):
        new = optax_next(p, opt, grads, count)
        # per tensor: max |difference| relative to the tensor's largest value
        return max(
            float(np.max(np.abs(new[k] - ref[f"next/{k}"])) / np.max(np.abs(ref[f"next/{k}"])))
            for k in new
        )

    moved = max(float(np.max(np.abs(ref[f"next/{k}"] - params[k]))) for k in params)
    assert moved > 1e-4  # the step really moves the params
    assert worst(step) < 1e-5
    assert worst(step - 1) > 1e-4  # bias correction: a wrong count is seen
