"""DeepSpeed ZeRO-1/2/3 and BF16_Optimizer checkpoints: fp32 masters and Adam moments bit for bit,
one optax step equals DeepSpeed's (torch AdamW) next step, bad input is refused.

Fixtures are written once per session by the real DeepSpeed 0.19.8 on CPU/gloo
(tests/fixtures/ds_writer.py: 3 ranks, every param count not a multiple of 3, a tied head, a
frozen param, two param groups); references come from DeepSpeed's own gather API
(`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`), not from the files.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from fixtures import FIXTURES
from fixtures.ckpt_checks import (
    assert_export_equals,
    export_in_fresh_process,
    optax_next,
    run_writer,
)
from fixtures.torch_common import load_reference, reference_names
from meshes import fit

from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats import deepspeed as ds
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.io.byte_source import close_all, count_reads

WRITER = os.path.join(FIXTURES, "ds_writer.py")
VARIANTS = ["z1", "z2", "z3", "z2_bf16", "z3_bf16", "bf16opt"]
TAG = "global_step3"


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    run_writer(WRITER, out, env={**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"})
    return out


def optim_file(root, variant, rank):
    prefix = "bf16_" if "bf16" in variant else ""
    return os.path.join(
        root, variant, TAG, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    )


def osd(root, variant, rank):
    return torch_save.load(optim_file(root, variant, rank))["optimizer_state_dict"]


# -- the fixtures are what they claim ----------------------------------------------------------


def test_fixture_layouts_are_the_hard_ones(root):
    # ZeRO-2 strips the tail padding: the last rank's partition of the no-decay group is shorter
    z2 = [osd(root, "z2", r)["single_partition_of_fp32_groups"][1].size for r in range(3)]
    assert z2[2] < z2[0] == z2[1]
    # ZeRO-1 with parameter_alignment pads between params
    assert any(any(g) for g in osd(root, "z1", 0)["param_alignment_paddings"])
    # ZeRO-3: several sub-groups, params padded to a multiple of 3
    z3 = osd(root, "z3", 0)
    assert len(z3["fp32_flat_groups"]) == 3
    shapes = torch_save.load(
        os.path.join(root, "z3", TAG, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    )
    assert any(math.prod(s) % 3 for g in shapes["param_shapes"] for s in g.values())
    assert all(t.size == 0 for t in shapes["module"].values())  # placeholders
    # the BF16_Optimizer keeps its padding and has no zero_stage
    bf = osd(root, "bf16opt", 2)
    assert "zero_stage" not in bf and bf["group_paddings"][1] > 0
    assert shapes["shared_params"] == {"lm_head.weight": "wte.weight"}


# -- exact import ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_masters_and_moments_exact(root, variant):
    path = os.path.join(root, variant)
    assert detect(path) == "deepspeed"
    src = open_source(path)
    ref, info = load_reference(root, variant)
    trainable = reference_names(ref, "param")
    frozen = reference_names(ref, "frozen")
    assert sorted(src.tensors) == sorted(trainable + frozen + ["lm_head.weight"])
    for k in trainable:
        t = src.tensors[k]
        assert t.dtype == np.float32
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k
        for kind in ("exp_avg", "exp_avg_sq"):
            m = src.optimizer.slots[kind][k]
            assert np.array_equal(m.materialize(), ref[f"{kind}/{k}"]), (kind, k)
    for k in frozen:  # fp32 (ZeRO-2/3 fragments, fp32 module) or the bf16 module weight
        assert np.array_equal(
            src.tensors[k].materialize().astype(np.float32), ref[f"frozen/{k}"]
        ), k
    assert np.array_equal(src.tensors["lm_head.weight"].materialize(), ref["param/wte.weight"])
    assert src.optimizer.step == int(info["step"][0]) == 3 and src.step == 3
    hyper = src.optimizer.hyper
    assert {k: hyper[k] for k in ("lr", "eps", "weight_decay", "betas")} == {
        k: info["hyper"][k] for k in ("lr", "eps", "weight_decay", "betas")
    }
    assert set(hyper) - {"lr", "eps", "weight_decay", "betas"} <= {"decoupled_weight_decay", "amsgrad", "maximize"}
    assert src.topology == {"dp": 3} and src.hf_rules == ""


def test_tag_folder_opens_directly(root):
    src = ds.open(os.path.join(root, "z2", TAG))
    ref, _ = load_reference(root, "z2")
    assert np.array_equal(src.tensors["fc1.weight"].materialize(), ref["param/fc1.weight"])


def test_zero3_padding_is_never_read(root):
    src = ds.open(os.path.join(root, "z3"))
    ref, _ = load_reference(root, "z3")
    t = src.tensors["fc1.weight"]  # 130 elements: 44 + 44 + 42 real, 2 of padding on rank 2
    with count_reads() as c:
        got = t.materialize()
    assert np.array_equal(got, ref["param/fc1.weight"])
    assert sum(v for k, v in c.items() if isinstance(k, str)) == 130 * 4
    with count_reads() as c:
        row = t.read((slice(5, 6),))
    assert np.array_equal(row[0], ref["param/fc1.weight"][5])
    assert sum(v for k, v in c.items() if isinstance(k, str)) == 10 * 4


# -- one optax step equals DeepSpeed's next step -------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_optax_step_matches_deepspeed_adamw(root, variant):
    src = ds.open(os.path.join(root, variant))
    ref, _ = load_reference(root, variant)
    keys = reference_names(ref, "next")
    grads = {k: ref[f"grad/{k}"] for k in keys}
    new = optax_next({k: src.tensors[k] for k in keys}, src.optimizer, grads, src.optimizer.step)
    assert max(float(np.max(np.abs(ref[f"next/{k}"] - ref[f"param/{k}"]))) for k in keys) > 1e-3
    for k, got in new.items():
        want = ref[f"next/{k}"]
        np.testing.assert_allclose(
            got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))), err_msg=k
        )


# -- bad input -------------------------------------------------------------------------------------


def copy_of(root, variant, tmp_path):
    path = tmp_path / variant
    shutil.copytree(os.path.join(root, variant), path)
    close_all()
    return path


def test_partition_count_must_match_the_files(root, tmp_path):
    path = copy_of(root, "z2", tmp_path)
    os.remove(path / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with pytest.raises(FormatError) as e:
        ds.open(str(path))
    msg = str(e.value)
    assert (
        "partition_count" in msg
        and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in msg
        and "2" in msg
    )


def edit_shapes(file, name, shape):
    d = torch.load(file, weights_only=True)  # our own fixture, written by DeepSpeed this session
    for group in d["param_shapes"]:
        if name in group:
            group[name] = torch.Size(shape)
    torch.save(d, file)


@pytest.mark.parametrize(
    "variant, model_file, key",
    [
        ("z2", "mp_rank_00_model_states.pt", "single_partition_of_fp32_groups"),
        ("bf16opt", "mp_rank_00_model_states.pt", "single_partition_of_fp32_groups"),
        ("z3", "zero_pp_rank_0_mp_rank_00_model_states.pt", "fp32_flat_groups"),
    ],
)
def test_numel_totals_must_add_up(root, tmp_path, variant, model_file, key):
    path = copy_of(root, variant, tmp_path)
    edit_shapes(path / TAG / model_file, "fc1.weight", (16, 10))
    with pytest.raises(FormatError) as e:
        ds.open(str(path))
    msg = str(e.value)
    assert model_file in msg and key in msg and "do not add up" in msg


def test_model_parallel_ranks_are_refused(root, tmp_path):
    path = copy_of(root, "z2", tmp_path)
    shutil.copy(
        path / TAG / "mp_rank_00_model_states.pt", path / TAG / "mp_rank_01_model_states.pt"
    )
    with pytest.raises(FormatError) as e:
        ds.open(str(path))
    assert "mp_rank" in str(e.value)


def test_latest_naming_a_missing_tag(root, tmp_path):
    path = copy_of(root, "z2", tmp_path)
    (path / "latest").write_text("global_step99")
    with pytest.raises(FormatError) as e:
        ds.open(str(path))
    assert "latest" in str(e.value) and "global_step99" in str(e.value)


# -- a real model through the whole path -----------------------------------------------------------


def test_llama_zero3_import_logits_and_orbax_roundtrip(root, tmp_path):
    """A transformers Llama trained by DeepSpeed ZeRO-3: exact masters and moments, logits equal to
    DeepSpeed's own forward pass, then import -> Orbax -> restore elsewhere -> export, bitwise."""
    from e2e import assert_same, roundtrip

    from hybridckpt import jobs

    path = os.path.join(root, "z3_llama")
    ref, info = load_reference(root, "z3_llama")
    src = open_source(path)
    assert src.config is not None and src.config.num_kv_heads == 2  # config.json beside it
    weights = {k: ref[f"param/{k}"] for k in reference_names(ref, "param")}
    assert any(v.size % 3 for v in weights.values())  # partitions padded on some params
    for k, w in weights.items():
        assert np.array_equal(src.tensors[k].materialize(), w), k
    got = jobs.logits(path, ref["tokens/tokens"], mesh=fit("fsdp=2,tp=2,pp=2"))
    np.testing.assert_allclose(got, ref["logits/tokens"], atol=1e-4, rtol=0)
    # vocab 61 and mlp 26 do not divide by tp: shard over fsdp and pp only
    params, mu, nu, step = roundtrip(path, str(tmp_path), mesh_a="fsdp=2,pp=2", mesh_b="dp=2,fsdp=4")
    assert_same(params, weights)
    assert_same(mu, {k: ref[f"exp_avg/{k}"] for k in weights}, "exp_avg")
    assert_same(nu, {k: ref[f"exp_avg_sq/{k}"] for k in weights}, "exp_avg_sq")
    assert step == 3


def test_export_straight_to_safetensors_copies_the_fp32_partitions(root, tmp_path):
    """`hybridckpt export ZERO OUT --optimizer` (zero_to_fp32's job, with the moments): the fp32
    masters and moments bit for bit. Each param is a flat range of the ranks' partitions, so the
    writer copies it file to file; no JAX is loaded."""
    out = str(tmp_path / "hf")
    probe = export_in_fresh_process(os.path.join(root, "z3_llama"), out)
    assert probe["loaded"] == [] and probe["equal"]
    ref, _ = load_reference(root, "z3_llama")
    opt = assert_export_equals(out, ref, reference_names(ref, "param"))
    assert int(opt["step"].materialize()) == 3
    assert probe["copied"] == probe["bytes"]  # every tensor byte copied, none read
