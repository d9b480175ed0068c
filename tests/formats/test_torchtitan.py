"""torchtitan 0.3 checkpoints (CheckpointManager `step-N/` DCP folders): Llama 3 with llama3 RoPE
scaling and Qwen3, q/k/v saved split while their moments are keyed by the fused `wqkv`.

Fixtures are written in this session by torch's real `dcp.save` in torchtitan 0.3.0's layout
(tests/fixtures/titan_writer.py, which cites the torchtitan code it follows, its layout checked
against torchtitan's own saves in tests/real/test_real_torchtitan.py), from transformers' own
models trained 3 AdamW steps; references are what torch itself computed (params, moments, the
next step's gradients and params) and transformers' forward pass.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
from e2e import assert_same, roundtrip
from fixtures.ckpt_checks import optax_next
from fixtures.titan_writer import STEPS, write_titan
from fixtures.torch_common import load_reference, reference_names
from meshes import cases

from hybridckpt import jobs, lazy, models, naming
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.formats import dcp
from hybridckpt.formats.dcp import torchtitan
from hybridckpt.formats.model_config import load_config_file
from hybridckpt.formats.registry import detect
from hybridckpt.rules import parse_rules

NAMES = ("llama3", "qwen3", "llama3_tied")
FUSED = "layers.0.attention.qkv_linear.wqkv.weight"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (root, paths) of each fixture."""
    out = {}
    for seed, name in enumerate(NAMES):
        root = str(tmp_path_factory.mktemp(name))
        out[name] = (root, write_titan(root, name, seed=seed))
    return out


def _config(paths):
    return load_config_file(os.path.join(paths["hf"], "config.json"))


def _open(paths):
    cfg = _config(paths)
    return dcp.open(paths["checkpoint"], config=cfg), cfg


# -- the fixture is torchtitan 0.3's layout ---------------------------------------------------


def test_fixture_layout_is_torchtitan_0_3(written):
    root, paths = written["qwen3"]
    md = read_metadata(paths["step"])
    keys = set(md.tensors)
    assert "tok_embeddings.weight" in keys and "lm_head.weight" in keys  # model at the top level
    assert "layers.0.attention.qkv_linear.wq.weight" in keys and "layers.0.attention.q_norm.weight" in keys
    assert not any(k.startswith("model.") for k in keys)
    # moments keyed by the fused parameter: [(heads + 2 * kv_heads) * head_dim, dim]
    assert md.tensors[f"optimizer.state.{FUSED}.exp_avg"].shape == ((4 + 2 * 2) * 12, 32)
    assert f"optimizer.state.{FUSED}.step" in keys
    assert not any(k.startswith("optimizer.state.") and ".wq." in k for k in keys)
    assert {"train_state.step", "lr_scheduler.last_epoch", "dataloader.world_size"} <= set(md.bytes_items)
    assert f"optimizer.param_groups.{FUSED}.lr" in md.bytes_items
    assert sorted(os.listdir(paths["checkpoint"])) == ["step-1", f"step-{STEPS}"]


def test_manager_folder_reads_its_latest_step_and_trainer_state(written):
    _, paths = written["llama3"]
    assert detect(paths["checkpoint"]) == "dcp" == detect(paths["step"])
    src, _ = _open(paths)
    assert src.step == src.optimizer.step == STEPS
    assert src.notes[0] == (f"torchtitan checkpoint folder: read step {STEPS}, step-{STEPS}/, of steps 1, {STEPS} "
                            f"(default {STEPS}: the latest)")
    assert src.trainer["train_state.step"] == STEPS and src.trainer["lr_scheduler.last_epoch"] == STEPS
    assert src.trainer["model_prefix"] == "" and src.trainer["optimizer_prefix"] == "optimizer."
    assert dcp.open(os.path.join(paths["checkpoint"], "step-1"), config=_config(paths)).step == 1
    assert {k: v for k, v in src.optimizer.hyper.items() if k in ("lr", "eps", "weight_decay", "betas")} == {
        "lr": 1e-2, "eps": 1e-8, "weight_decay": 0.1, "betas": [0.9, 0.95]}


def test_without_config_the_fused_moments_stay_fused(written):
    """No head counts, no split: `inspect` lists the checkpoint and says why."""
    _, paths = written["llama3"]
    src = dcp.open(paths["step"])
    assert src.config is None
    assert FUSED in src.optimizer.slots["exp_avg"]
    assert any("stays fused" in n and "--config" in n for n in src.notes)
    info = jobs.inspect(paths["checkpoint"])
    assert info["needs_config"] and info["step"] == STEPS


# -- names, RoPE and the fused moments: bit for bit -------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_params_and_moments_exact_under_hf_names(written, name):
    root, paths = written[name]
    src, cfg = _open(paths)
    ref, _ = load_reference(root, name)
    hf = naming.source_to_hf(src, cfg)
    assert hf.report == ()
    assert sorted(hf.params) == reference_names(ref, "param")
    for k, t in hf.params.items():
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k
        for slot in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(hf.slots[slot][k].materialize(), ref[f"{slot}/{k}"]), (slot, k)
    wq = src.tensors["layers.0.attention.qkv_linear.wq.weight"].materialize()
    q = ref["param/model.layers.0.self_attn.q_proj.weight"]
    # Llama 3 (ComplexRoPE) rows are permuted like Meta's; Qwen3's (CosSinRoPE) are HF's own
    assert np.array_equal(wq, q) == (name == "qwen3")


def test_fused_rows_are_per_kv_group_not_q_then_k_then_v(written):
    """torchtitan's wqkv holds [q q | k | v] per kv group: cutting it as [all q | all k | all v]
    gives other rows (the check can fail)."""
    root, paths = written["qwen3"]
    src, _ = _open(paths)
    ref, _ = load_reference(root, "qwen3")
    fused = src.optimizer.slots["exp_avg"]["layers.0.attention.qkv_linear.wq.weight"].materialize()
    assert np.array_equal(fused, ref["exp_avg/model.layers.0.self_attn.q_proj.weight"])
    raw = dcp.open(paths["step"]).optimizer.slots["exp_avg"][FUSED].materialize()
    assert not np.array_equal(raw[: 4 * 12], fused)


# -- the whole path --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, mesh_a, mesh_b", cases([("llama3", "fsdp=2,tp=2,pp=2", "tp=4,pp=2"), ("qwen3", "tp=2,pp=2", "fsdp=2,tp=2,pp=2")])
)
def test_import_restore_export_and_logits(written, tmp_path, name, mesh_a, mesh_b):
    """torchtitan -> Orbax on mesh A -> restore on mesh B -> export: bitwise torch's params and
    moments; the imported model's logits equal transformers' (fp32, 1e-4)."""
    import torch
    import transformers

    root, paths = written[name]
    ref, _ = load_reference(root, name)
    config = os.path.join(paths["hf"], "config.json")
    params, mu, nu, step = roundtrip(paths["checkpoint"], str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b, config=config)
    assert_same(params, {k: ref[f"param/{k}"] for k in reference_names(ref, "param")})
    assert_same(mu, {k: ref[f"exp_avg/{k}"] for k in params}, "exp_avg")
    assert_same(nu, {k: ref[f"exp_avg_sq/{k}"] for k in params}, "exp_avg_sq")
    assert step == STEPS
    model = transformers.AutoModelForCausalLM.from_pretrained(
        paths["hf"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with open(os.path.join(root, "tokens.json")) as f:
        tokens = np.array(json.load(f), dtype=np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(os.path.join(str(tmp_path), "orbax"), tokens, mesh=mesh_b)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# -- one optax step equals torch AdamW's next step -------------------------------------------------


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_optax_step_matches_torch_adamw(written, name):
    """The next step's gradients, saved in torchtitan's parameter layout (fused wqkv, permuted
    rows), go through the same split and rules as the moments; one optax AdamW step from the
    imported params and moments then equals torch's."""
    root, paths = written[name]
    src, cfg = _open(paths)
    ref, _ = load_reference(root, name)
    hf = naming.source_to_hf(src, cfg)
    v = models.rule_variables(cfg)
    grads = {k: lazy.ArrayTensor(ref[f"grad/{k}"]) for k in reference_names(ref, "grad")}
    assert FUSED in grads
    grads = torchtitan.split_fused_qkv(grads, v["num_heads"], v["num_kv_heads"])
    rules = parse_rules(src.hf_rules, {**v, **src.rule_vars})
    grads = {k: t.materialize() for k, t in rules.apply(grads).tensors.items()}
    assert sorted(grads) == sorted(hf.params)
    opt = types.SimpleNamespace(hyper=src.optimizer.hyper, slots=hf.slots)
    new = optax_next(hf.params, opt, grads, src.optimizer.step)
    for k, got in new.items():
        want = ref[f"next/{k}"]
        assert np.max(np.abs(want - ref[f"param/{k}"])) > 1e-4  # the step really moves it
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))), err_msg=k)
    wrong = optax_next(hf.params, opt, grads, src.optimizer.step - 1)  # bias correction matters
    assert max(float(np.max(np.abs(wrong[k] - ref[f"next/{k}"]))) for k in wrong) > 1e-4
