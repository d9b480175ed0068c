"""Trainer / accelerate folders and DeepSpeed universal checkpoints: what the readers refuse,
and the plain (no FSDP, no DeepSpeed) layout with a torch optimizer state written by torch.

The real-tool cases (tests/real/test_real_trainer.py) cover the FSDP, DeepSpeed and universal
layouts end to end; here each refusal is one line from the error family naming the file.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from hybridckpt.errors import CheckpointError, FormatError
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.optim import groups

REAL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "real", "cases")


def _copy(case: str, tmp_path, sub: str = "") -> str:
    dst = str(tmp_path / case)
    shutil.copytree(os.path.join(REAL, case, "ckpt"), dst)
    return os.path.join(dst, sub) if sub else dst


def _plain(tmp_path, named: bool) -> tuple[str, dict, dict]:
    """A Trainer-style plain folder: model.safetensors, optimizer.pt (torch's own state dict of
    an AdamW over two groups, by index, with param_names when built from named params),
    trainer_state.json."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    named_params = list(model.named_parameters())
    decay = [(n, p) for n, p in named_params if p.ndim == 2]
    no_decay = [(n, p) for n, p in named_params if p.ndim < 2]
    pick = (lambda g: g) if named else (lambda g: [p for _, p in g])
    opt = torch.optim.AdamW([{"params": pick(decay), "weight_decay": 0.1},
                             {"params": pick(no_decay), "weight_decay": 0.0}], lr=0.01, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    save_file({n: p.detach().contiguous() for n, p in named_params}, str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), str(folder / "optimizer.pt"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": [{"learning_rate": 0.01}]}))
    moments = {n: opt.state[p]["exp_avg"].numpy() for n, p in named_params}
    return str(folder), {n: p.detach().numpy() for n, p in named_params}, moments


@pytest.mark.parametrize("named", [True, False])
def test_plain_folder_with_torch_optimizer(tmp_path, named):
    folder, params, moments = _plain(tmp_path, named)
    assert detect(folder) == "hf-trainer"
    src = open_source(folder)
    assert src.step == 2 and src.trainer["lr"] == 0.01
    for n, p in params.items():
        assert np.array_equal(src.tensors[n].materialize(), p)
    if not named:  # index-keyed without names: read by index, named where a model order is known
        assert src.optimizer is None and src.index_optimizer.tool == "trainer"
        assert [len(g["params"]) for g in src.index_optimizer.groups] == [1, 3]
        assert np.array_equal(src.index_optimizer.state[0]["exp_avg"].materialize(), moments["0.weight"])
        from hybridckpt.jobs import open_checkpoint

        opened = open_checkpoint(folder)  # no model config, no --param-order: weights only, said
        assert not opened.named.slots
        assert any("keyed by parameter index: not imported" in n for n in opened.notes)
        opened = open_checkpoint(folder, param_order=list(params))  # named_parameters() order, given
        for n, m in moments.items():
            assert np.array_equal(opened.named.slots["exp_avg"][n].materialize(), m), n
        return
    slots = src.optimizer.slots["exp_avg"]
    for n, m in moments.items():
        assert np.array_equal(slots[n].materialize(), m), n
    h = src.optimizer.hyper
    assert h["lr"] == 0.01 and [g["weight_decay"] for g in h["groups"]] == [0.1, 0.0]
    assert h["groups"][1]["params"] == ["0.bias", "1.weight", "1.bias"]


def test_damaged_trainer_files_name_the_file(tmp_path):
    folder = _copy("hf_trainer_fsdp2_sharded", tmp_path, "checkpoint-3")
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": "three"}, f)
    with pytest.raises(FormatError, match="trainer_state.json: global_step"):
        open_source(folder)
    folder = _copy("hf_trainer_fsdp2_full", tmp_path, "checkpoint-3")
    with open(os.path.join(folder, "scheduler.pt"), "wb") as f:
        f.write(b"not a torch.save file")
    with pytest.raises(FormatError, match="scheduler.pt"):
        open_source(folder)


def test_per_rank_fsdp_files_refused(tmp_path):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "pytorch_model_fsdp_0_rank0.bin").write_bytes(b"x")
    (folder / "trainer_state.json").write_text("{}")
    assert detect(str(folder)) == "hf-trainer"
    with pytest.raises(FormatError, match="per-rank FSDP files"):
        open_source(str(folder))


def test_universal_hostile_tag_and_shapes(tmp_path):
    root = _copy("deepspeed_universal_zero2", tmp_path)
    with open(os.path.join(root, "latest_universal"), "w") as f:
        f.write("../../etc")
    with pytest.raises(FormatError, match="latest_universal"):
        open_source(root)
    root = _copy("deepspeed_universal_zero2", tmp_path / "b")
    tag = os.path.join(root, "global_step3_universal", "zero")
    a, b = "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"
    shutil.copy(os.path.join(tag, b, "exp_avg.pt"), os.path.join(tag, a, "exp_avg.pt"))
    with pytest.raises(FormatError, match="exp_avg.pt: shape"):
        open_source(root)


def test_groups_optax_cannot_express_are_refused():
    leaf = {"a": ["a"], "b": ["b"]}
    base = {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8}
    ok = {**base, "groups": [{**base, "weight_decay": 0.1, "params": ["a"]}, {**base, "weight_decay": 0.0, "params": ["b"]}]}
    scalars, mask = groups.weight_decay_mask(ok, leaf.get, ["a", "b"], "x")
    assert mask == {"a": True, "b": False} and scalars["weight_decay"] == 0.1
    lr = {**base, "groups": [{**base, "lr": 1.0, "params": ["a"]}, {**base, "params": ["b"]}]}
    with pytest.raises(CheckpointError, match="differ in \\['lr'\\]"):
        groups.weight_decay_mask(lr, leaf.get, ["a", "b"], "x")
    two = {**base, "groups": [{**base, "weight_decay": 0.1, "params": ["a"]}, {**base, "weight_decay": 0.2, "params": ["b"]}]}
    with pytest.raises(CheckpointError, match="one weight decay and 0"):
        groups.weight_decay_mask(two, leaf.get, ["a", "b"], "x")
    with pytest.raises(CheckpointError, match="holds params of a decayed and an undecayed group"):
        groups.weight_decay_mask(ok, lambda n: ["stacked"], ["stacked"], "x")
    with pytest.raises(CheckpointError, match="no param group names"):
        groups.weight_decay_mask(ok, leaf.get, ["a", "b", "c"], "x")
