"""formats/index_optim.py: a torch optimizer state dict keyed by index, as a file holds it, each
rule broken once (one FormatError naming the file and the key), and index_names' checks on a
state built here (no model: the names given)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats import index_optim
from hybridckpt.lazy import ArrayTensor
from hybridckpt.optim import index_names


def _sd(n: int = 3) -> dict:
    state = {i: {"step": 2.0, "exp_avg": ArrayTensor(np.full((i + 1,), i, np.float32)),
                 "exp_avg_sq": ArrayTensor(np.ones((i + 1,), np.float32))} for i in range(n)}  # fmt: skip
    return {"state": state, "param_groups": [{"lr": 0.1, "weight_decay": 0.1, "params": [0, 1]},
                                             {"lr": 0.1, "weight_decay": 0.0, "params": [2]}]}


def test_read_and_name_in_turn():
    ko = index_optim.read(_sd(), "opt.pt", "torch")
    assert index_optim.is_index_keyed(_sd()) and not index_optim.is_index_keyed({"state": {"a": {}}, "param_groups": []})
    shapes = {"a": (1,), "b": (2,), "c": (3,)}
    opt, notes = index_names.named(ko, index_names.given(ko, ["a", "b", "c"], shapes, "given"), shapes)
    assert [float(opt.slots["exp_avg"][n].materialize()[0]) for n in "abc"] == [0.0, 1.0, 2.0]
    assert opt.step == 2 and [g["params"] for g in opt.hyper["groups"]] == [["a", "b"], ["c"]]
    assert notes == ["opt.pt keyed by index: named by the order given (given), groups 2 / 1 in turn"]
    with pytest.raises(FormatError, match=r"opt.pt: .*state\[1\] exp_avg has shape \(2,\), but c \(group 0\) needs \(3,\)"):
        index_names.named(ko, index_names.given(ko, ["a", "c", "b"], {"a": (1,), "b": (3,), "c": (3,)}, "g"),
                          {"a": (1,), "b": (3,), "c": (3,)})
    with pytest.raises(ConfigError, match="given: 'a' is listed twice"):
        index_names.given(ko, ["a", "a", "c"], shapes, "given")


@pytest.mark.parametrize("edit, words", [
    (lambda sd: sd["param_groups"][1]["params"].append(0), r"param_groups\[1\]\['params'\]: index 0 is also in group 0"),
    (lambda sd: sd["param_groups"][0]["params"].append("x"), r"expected parameter indices .* found 'x'"),
    (lambda sd: sd["param_groups"][0]["params"].append(True), r"expected parameter indices .* found True"),
    (lambda sd: sd["state"].update({7: {}}), r"state\[7\]: expected the index of a parameter of param_groups \(0..2\)"),
    (lambda sd: sd["state"].update({0: [1, 2]}), r"state\[0\]: expected a dict of optimizer state"),
    (lambda sd: sd.update(param_groups=[1]), r"'param_groups' a list of dicts"),
])
def test_hostile_state_dicts_are_one_line(edit, words):
    sd = _sd()
    edit(sd)
    with pytest.raises(FormatError, match=words) as e:
        index_optim.read(sd, "opt.pt", "torch")
    assert str(e.value).startswith("opt.pt: ") and "\n" not in str(e.value)
