"""Optimizer state keyed by parameter INDEX, as the Trainer, accelerate and Lightning wrote it
(`generators/index_optim.py`, issue 40): what the files hold, read through our restricted
unpickler and DCP reader, against the tool's runtime.

Each case's manifest lists its param groups as torch held them, with the parameter NAMES in
index order (`hyper[g]["names"]`): the truth an importer must recover, since no file records
it. These tests pin that our readers see the tool's bytes (every moment and parameter bitwise
the runtime's through that order), and the layout facts an importer relies on: the Trainer's
two groups (decay names first, each in `named_parameters()` order), accelerate's and
Lightning's one group, Lightning's attribute prefix, the FSDP folder's keys by name.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from cases import ckpt, manifest, reference

from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.containers.pickle import torch_save
from hybridckpt.formats.dcp.storage import entry_tensor, load_item

FILES = {
    "hf_trainer_index": "checkpoint-3/optimizer.pt",
    "accelerate_index": "checkpoint-3/optimizer.bin",
    "lightning_ckpt_index": "step=3.ckpt",
}
# transformers 5.24 `Trainer.get_decay_parameter_names`: no decay for these names
NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def _optimizer(case: str) -> dict:
    obj = torch_save.load(ckpt(case, FILES[case]))
    return obj["optimizer_states"][0] if case.startswith("lightning") else obj


def _hf_order(case: str) -> list[str]:
    """`LlamaForCausalLM.named_parameters()` order, as the generator recorded it from the module."""
    return manifest(case)["named_parameters"]


@pytest.mark.parametrize("case", sorted(FILES))
def test_each_index_holds_the_moments_of_the_name_the_manifest_gives(case):
    opt, ref, groups = _optimizer(case), reference(case), manifest(case)["hyper"]
    assert len(opt["param_groups"]) == len(groups)
    seen = []
    for g, want in zip(opt["param_groups"], groups, strict=True):
        assert len(g["params"]) == len(want["names"])
        assert g["weight_decay"] == want["weight_decay"] and g["lr"] == want["lr"]
        for i, name in zip(g["params"], want["names"], strict=True):
            st = opt["state"][i]
            for slot in ("exp_avg", "exp_avg_sq"):
                got = np.asarray(st[slot].materialize())
                assert got.dtype == np.float32 and np.array_equal(got, ref[f"{slot}/{name}"]), (case, i, name, slot)
            seen.append(i)
    assert sorted(seen) == list(range(len(seen))) == sorted(opt["state"])  # indices 0..N-1, each once


def test_the_trainer_groups_are_its_decay_rule_in_named_parameters_order():
    """Group 0: the names the rule decays, group 1: the rest, each in module order; q_proj/o_proj
    and k_proj/v_proj have equal shapes, so shapes alone could not place them."""
    names = _hf_order("hf_trainer_index")
    decays = [n for n in names if not any(re.search(p, n.lower()) for p in NO_DECAY)]
    rest = [n for n in names if n not in decays]
    g0, g1 = manifest("hf_trainer_index")["hyper"]
    assert (g0["names"], g0["weight_decay"]) == (decays, 0.1)
    assert (g1["names"], g1["weight_decay"]) == (rest, 0.0)
    ref = reference("hf_trainer_index")
    assert ref["param/model.layers.0.self_attn.q_proj.weight"].shape == ref["param/model.layers.0.self_attn.o_proj.weight"].shape


@pytest.mark.parametrize("case", ["accelerate_index", "lightning_ckpt_index"])
def test_one_group_in_named_parameters_order(case):
    (g,) = manifest(case)["hyper"]
    assert g["names"] == _hf_order(case)


def test_the_lightning_file_keeps_the_weights_under_its_attribute_prefix():
    obj = torch_save.load(ckpt("lightning_ckpt_index", "step=3.ckpt"))
    ref = reference("lightning_ckpt_index")
    assert obj["global_step"] == 3
    assert sorted(obj["state_dict"]) == sorted(f"model.{n}" for n in _hf_order("lightning_ckpt_index"))
    for name in _hf_order("lightning_ckpt_index"):
        assert np.array_equal(np.asarray(obj["state_dict"][f"model.{name}"].materialize()), ref[f"param/{name}"]), name


def test_the_lightning_fsdp_folder_is_dcp_keyed_by_name():
    """`FSDPStrategy(state_dict_type="sharded")`: model tensors `model.<attribute>.<HF name>`,
    moments `optimizer_0.state.<attribute>.<HF name>.<slot>`, groups listing names; `meta.pt`
    holds Lightning's own state (no tensors)."""
    folder = ckpt("lightning_fsdp_sharded", "step=3.ckpt")
    md, ref = read_metadata(folder), reference("lightning_fsdp_sharded")
    names = _hf_order("lightning_fsdp_sharded")
    for name in names:
        got = entry_tensor(md.tensors[f"model.model.{name}"]).materialize()
        assert np.array_equal(got, ref[f"param/{name}"]), name
        for slot in ("exp_avg", "exp_avg_sq"):
            got = entry_tensor(md.tensors[f"optimizer_0.state.model.{name}.{slot}"]).materialize()
            assert np.array_equal(got, ref[f"{slot}/{name}"]), (name, slot)
    for g, want in enumerate(manifest("lightning_fsdp_sharded")["hyper"]):
        assert load_item(md, f"optimizer_0.param_groups.{g}.params") == [f"model.{n}" for n in want["names"]]
    meta = torch_save.load(ckpt("lightning_fsdp_sharded", "step=3.ckpt", "meta.pt"))
    assert meta["global_step"] == 3 and "state_dict" not in meta and "optimizer_states" not in meta
