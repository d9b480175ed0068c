"""Exports never drop a tensor silently (issue 38): a name a target cannot hold, or that its
own structure would read as something else, is refused in one line with nothing written.

The sources are model-agnostic (an architecture no family implements: every tensor keeps its
own name), the only exports whose names come from the checkpoint rather than a family's rules:
`--to hf` and `--to dcp`; the other targets need a model config and refuse such a source.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from attacks.hostile import make_world, unknown_arch_folder
from test_hostile import cli, one_line

from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.jobs.open import open_checkpoint

SLOT_LIKE = {"w": np.arange(16, dtype=np.float32).reshape(4, 4), "optim.state.w.exp_avg": np.full((4, 4), 7, np.float32),
             "x.step": np.arange(3, dtype=np.float32)}


def _dcp_source(folder: str, tensors: dict[str, np.ndarray]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({k: torch.from_numpy(v) for k, v in tensors.items()}, checkpoint_id=folder, no_dist=True)


def test_a_tensor_named_like_a_slot_is_refused_on_dcp(tmp_path, capsys):
    """`optim.state.w.exp_avg` beside `w`: written as the DCP key `model.optim.state.w.exp_avg`
    it reads back as Adam's first moment of `w` and the tensor is gone (today: exported, a
    tensor fewer on the way back)."""
    w = make_world(tmp_path)
    unknown_arch_folder(w.src, SLOT_LIKE)
    out = os.path.join(w.root, "out")
    code, _, err = cli(capsys, "export", w.src, out, "--to", "dcp")
    one_line(code, err, "optim.state.w.exp_avg", "slot of 'w'")
    assert not os.path.exists(out) and w.leftovers() == []
    # --to hf holds it: every tensor back under its own name and values
    code, _, err = cli(capsys, "export", w.src, out)
    assert code == 0, err
    got = read_header(os.path.join(out, "model.safetensors")).tensors
    assert {k: v.materialize().tolist() for k, v in got.items()} == {k: v.tolist() for k, v in SLOT_LIKE.items()}


def test_names_that_only_look_like_state_round_trip_through_dcp(tmp_path, capsys):
    """The control: `state`, `x.step`, `optim.state` (no param it could be the state of) are
    plain tensors in the DCP written and read back so, values exact."""
    w = make_world(tmp_path)
    tensors = {"w": np.arange(6, dtype=np.float32), "state": np.ones(2, np.float32), "x.step": np.zeros(3, np.float32),
               "optim.state": np.full(2, 5, np.float32), "a.state.b": np.full(2, 9, np.float32)}
    unknown_arch_folder(w.src, tensors)
    out = os.path.join(w.root, "out")
    code, _, err = cli(capsys, "export", w.src, out, "--to", "dcp")
    assert code == 0, err
    back = open_checkpoint(out).named
    assert sorted(back.params) == sorted(tensors)
    for k, v in tensors.items():
        assert np.array_equal(back.params[k].materialize(), v)


def test_a_tensor_safetensors_cannot_name_is_refused_on_hf(tmp_path, capsys):
    """`__metadata__` is the safetensors header's own key: written as a tensor the file was
    unreadable (today: exported, then 'values must be strings' on every read). DCP holds it."""
    w = make_world(tmp_path)
    tensors = {"__metadata__": np.arange(3, dtype=np.float32), "w": np.ones((2, 2), np.float32)}
    _dcp_source(w.src, tensors)
    out = os.path.join(w.root, "out")
    code, _, err = cli(capsys, "export", w.src, out)
    one_line(code, err, "__metadata__", "safetensors")
    assert not os.path.exists(out) and w.leftovers() == []
    code, _, err = cli(capsys, "export", w.src, out, "--to", "dcp")
    assert code == 0, err
    back = open_checkpoint(out).named
    assert np.array_equal(back.params["__metadata__"].materialize(), tensors["__metadata__"])


@pytest.mark.parametrize("to", ["torchtitan", "megatron", "paddlenlp-unified", "paddleformers-unified", "maxtext"])
def test_targets_named_by_a_family_refuse_a_source_without_one(tmp_path, capsys, to):
    """A target whose names are a family's (torchtitan, Megatron, Paddle, MaxText) cannot hold
    a model-agnostic source's own names: one line, nothing written, no tensor dropped."""
    w = make_world(tmp_path)
    unknown_arch_folder(w.src, SLOT_LIKE)
    out = os.path.join(w.root, "out")
    code, _, err = cli(capsys, "export", w.src, out, "--to", to)
    one_line(code, err, "needs a model config")
    assert not os.path.exists(out) and w.leftovers() == []
