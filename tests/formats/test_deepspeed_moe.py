"""DeepSpeed MoE (`deepspeed.moe.layer.MoE`, ep_size 2 on 4 ranks, ZeRO-2): per-expert files and
expert-parallel optimizer groups read into HF's per-expert names, masters and Adam moments bit for
bit; one optax step equals DeepSpeed's next step; a wrong EP layout or a lost expert is refused.

The fixture is written once per module by the real DeepSpeed 0.19.8 on CPU/gloo
(tests/fixtures/ds_moe_writer.py: transformers' Qwen3-MoE with DeepSpeed MoE blocks whose experts
are transformers' own Qwen3MoeMLP); references come from DeepSpeed's own gather API on every rank
(`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`), not from the files.
"""

from __future__ import annotations

import os
import shutil
import types

import numpy as np
import pytest
import torch
from e2e import assert_same, roundtrip
from fixtures import FIXTURES
from fixtures.ckpt_checks import optax_next, run_writer
from fixtures.torch_common import load_reference, reference_names
from meshes import fit_pair

from hybridckpt import jobs, lazy
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats import deepspeed as ds
from hybridckpt.formats.deepspeed import experts
from hybridckpt.formats.deepspeed.ranks import read_rank
from hybridckpt.formats.registry import detect
from hybridckpt.rules import parse_rules

WRITER = os.path.join(FIXTURES, "ds_moe_writer.py")
TAG = "global_step3"
VARIANTS = ["z2", "z2_bf16", "z2_de"]  # ds_moe_writer.VARIANTS (z2_de: D + E rank layout)
GATE = "model.layers.{}.mlp.experts.{}.gate_proj.weight"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed_moe")
    run_writer(WRITER, out, env={**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"})
    return str(out)


def _tag(root) -> str:
    return os.path.join(root, "z2", TAG)


def _hf(src):
    """(params, slots) under HF names by the source's own rules."""
    rules = parse_rules(src.hf_rules, {})
    params = rules.apply(src.tensors).tensors
    slots = {s: rules.apply(t, strict=False).tensors for s, t in src.optimizer.slots.items()}
    return params, slots


# -- the fixture is DeepSpeed's MoE layout -----------------------------------------------------


def test_fixture_layout_is_deepspeed_moe(root):
    names = sorted(os.listdir(_tag(root)))
    assert [n for n in names if n.startswith("layer_")] == [
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)
    ]
    # an expert file holds one expert under its GLOBAL id
    f = torch_save.load(os.path.join(_tag(root), "layer_1_expert_3_mp_rank_00_model_states.pt"))
    assert sorted(f) == [
        f"model.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.{p}_proj.weight"
        for p in ("down", "gate", "up")
    ]
    m = torch_save.load(os.path.join(_tag(root), "mp_rank_00_model_states.pt"))
    assert m["num_experts"] == [4, 4]
    assert not any("deepspeed_experts" in k for k in m["module"])  # experts only in their files
    # param_shapes name the expert group with rank 0's LOCAL ids (0, 1 of 2 per EP rank)
    assert {n.split("deepspeed_experts.")[1][0] for n in m["param_shapes"][1]} == {"0", "1"}
    _, r1, pc = read_rank(os.path.join(_tag(root), "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    assert pc == [4, 2] and r1.groups[1]["name"] == "ep_size_2" and r1.groups[1]["moe"]
    bf16 = os.path.join(root, "z2_bf16", TAG)
    f = torch_save.load(os.path.join(bf16, "layer_0_expert_2_mp_rank_00_model_states.pt"))
    assert {str(t.dtype) for t in f.values()} == {"bfloat16"}
    assert os.path.isfile(os.path.join(bf16, "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"))


# -- exact import ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_masters_and_moments_exact_under_hf_per_expert_names(root, variant):
    """fp32 masters (bf16 run: the expert files and module hold bf16 copies) and moments."""
    assert detect(os.path.join(root, variant)) == "deepspeed"
    src = ds.open(os.path.join(root, variant))
    ref, info = load_reference(root, variant)
    params, slots = _hf(src)
    assert sorted(params) == reference_names(ref, "param")  # every expert of every EP rank
    for k, t in params.items():
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k
        for slot in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(slots[slot][k].materialize(), ref[f"{slot}/{k}"]), (slot, k)
    assert src.optimizer.step == 3 and info["step"] == [3.0]
    assert any("2 MoE layers, 8 experts over ep_size 2" in n for n in src.notes)
    # EP rank 1's experts (global 2, 3) are not EP rank 0's (the check can fail)
    assert not np.array_equal(
        params[GATE.format(0, 2)].materialize(), ref[f"param/{GATE.format(0, 0)}"]
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_optax_step_matches_deepspeed_adamw(root, variant):
    src = ds.open(os.path.join(root, variant))
    ref, _ = load_reference(root, variant)
    params, slots = _hf(src)
    grads = {k: ref[f"grad/{k}"] for k in params}
    opt = types.SimpleNamespace(hyper=src.optimizer.hyper, slots=slots)
    new = optax_next(params, opt, grads, src.optimizer.step)
    for k, got in new.items():
        want = ref[f"next/{k}"]
        assert np.max(np.abs(want - ref[f"param/{k}"])) > 1e-5, k
        np.testing.assert_allclose(
            got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))), err_msg=k
        )


# -- the whole path, with the Qwen3-MoE family ----------------------------------------------------


def test_import_restore_export_bitwise_and_the_export_runs_in_transformers(root, tmp_path):
    """DeepSpeed -> Orbax on mesh A -> restore on mesh B (experts over dp) -> export: bitwise
    DeepSpeed's masters and moments under HF's names; transformers loads the export as a
    Qwen3MoeForCausalLM whose logits equal the imported model's (fp32, 1e-4). (DeepSpeed's own
    forward routes with its TopKGate (capacity, noise), not HF's router: not a reference.)"""
    import transformers

    ref, _ = load_reference(root, "z2")
    mesh_b, mesh_a = fit_pair("dp=4,fsdp=2", "dp=2,tp=2,pp=2", keep="dp")  # mesh B keeps dp first
    params, mu, nu, step = roundtrip(os.path.join(root, "z2"), str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, {k: ref[f"param/{k}"] for k in reference_names(ref, "param")})
    assert_same(mu, {k: ref[f"exp_avg/{k}"] for k in params}, "exp_avg")
    assert_same(nu, {k: ref[f"exp_avg_sq/{k}"] for k in params}, "exp_avg_sq")
    assert step == 3
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "exported", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(back) is transformers.Qwen3MoeForCausalLM
    tokens = np.arange(1, 11, dtype=np.int32)[None] * 5 % 64
    with torch.no_grad():
        want = back(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path / "orbax"), tokens, mesh=mesh_b)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# -- a wrong expert-parallel layout, a lost expert --------------------------------------------------


def _copy(root, tmp_path) -> str:
    out = str(tmp_path / "z2")
    shutil.copytree(os.path.join(root, "z2"), out)
    return out


def test_the_data_before_expert_layout_puts_other_experts_at_each_offset(root):
    """Read as D + E (`use_data_before_expert_parallelism`), the same partitions give other
    experts at each offset: the layout matters and the check below can fail."""
    folder = _tag(root)
    read = [
        read_rank(os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        for r in range(4)
    ]
    ranks = [r for _, r, _ in read]
    shapes = torch_save.load(os.path.join(folder, "mp_rank_00_model_states.pt"))["param_shapes"]
    ref, _ = load_reference(root, "z2")
    # layer 1's local expert 0 sits in the second partition of its EP rank's flat group
    name = "model.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.{}.gate_proj.weight"
    for data_first, same in ((False, True), (True, False)):
        params, ep = experts.zero12_moe(
            ranks, [4, 2], shapes, {"use_data_before_expert_parallelism": data_first}, True, "m"
        )
        got = params[name.format(0)]["fp32"].materialize()
        assert ep == 2 and np.array_equal(got, ref[f"param/{GATE.format(1, 0)}"]) == same


@pytest.mark.parametrize("variant, data_first", [("z2", True), ("z2_de", False)])
def test_a_layout_that_does_not_fit_the_expert_files_is_refused(
    root, tmp_path, variant, data_first
):
    """ds_config saying D + E for an E + D run, or not saying it for a D + E run: every rebuilt
    expert is compared (one row) with its expert file, and the mismatch is one line naming it."""
    out = str(tmp_path / variant)
    shutil.copytree(os.path.join(root, variant), out)
    path = os.path.join(out, TAG, "mp_rank_00_model_states.pt")
    m = torch.load(path, weights_only=False)
    m["ds_config"]["use_data_before_expert_parallelism"] = data_first
    torch.save(m, path)
    with pytest.raises(
        FormatError, match=r"deepspeed_experts\.\d\..*do not hold its expert file's weights"
    ):
        ds.open(out)


def test_a_lost_expert_file_is_refused(root, tmp_path):
    out = _copy(root, tmp_path)
    os.remove(os.path.join(out, TAG, "layer_1_expert_2_mp_rank_00_model_states.pt"))
    with pytest.raises(
        FormatError,
        match=r"not in a file \['model\.layers\.1\.mlp\.deepspeed_moe\.experts\.deepspeed_experts\.2\.",
    ):
        ds.open(out)


def test_a_lost_ep_rank_optim_file_is_refused(root, tmp_path):
    out = _copy(root, tmp_path)
    os.remove(os.path.join(out, TAG, "zero_pp_rank_3_mp_rank_00_optim_states.pt"))
    with pytest.raises(FormatError, match=r"partition_count\[0\] is 4, but 3 optim files"):
        ds.open(out)


def test_without_zero_the_module_and_expert_files_give_the_weights(root):
    """No ZeRO (`z0`): the weights from the module and the expert files, bitwise; the
    `expp_rank_*` torch optimizer states (by parameter index, no names) are not read, and say so."""
    names = sorted(os.listdir(os.path.join(root, "z0", TAG)))
    assert "expp_rank_1_mp_rank_00_optim_states.pt" in names
    src = ds.open(os.path.join(root, "z0"))
    assert src.optimizer is None
    assert any("expp_rank_*_optim_states.pt" in n and "not read" in n for n in src.notes)
    params = parse_rules(src.hf_rules, {}).apply(src.tensors).tensors
    ref, _ = load_reference(root, "z0")
    assert sorted(params) == reference_names(ref, "param")
    for k, t in params.items():
        assert isinstance(t, lazy.LazyTensor)
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k


def test_pipeline_engine_layer_files_are_still_refused(root, tmp_path):
    """`layer_{idx:02d}-model_{mp:02d}-model_states.pt` (runtime/pipe/module.py `ckpt_layer_path`)
    is the pipeline engine's, not an expert file."""
    out = _copy(root, tmp_path)
    shutil.copy(
        os.path.join(out, TAG, "layer_0_expert_0_mp_rank_00_model_states.pt"),
        os.path.join(out, TAG, "layer_01-model_00-model_states.pt"),
    )
    with pytest.raises(
        FormatError, match="pipeline-engine DeepSpeed checkpoints are not supported"
    ):
        ds.open(out)
