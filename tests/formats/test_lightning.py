"""The `lightning` format beyond its real cases (tests/real/test_real_lightning.py): the attribute
prefix rule, detection against plain torch files, and hostile `.ckpt` files and `meta.pt` built
from Lightning's own checkpoint (the committed case, changed with torch), each one line and exit 2
from the CLI."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from hybridckpt.cli import main
from hybridckpt.errors import FormatError
from hybridckpt.formats.lightning import prefix
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.io.byte_source import close_all

REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real", "cases")
FILE = os.path.join(REAL, "lightning_ckpt_index", "ckpt")
SHARDED = os.path.join(REAL, "lightning_fsdp_sharded", "ckpt")


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    close_all()
    return code, capsys.readouterr().err


def one_line(code: int, err: str, *must: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    for m in must:
        assert m in err, (m, err)


def _variant(tmp_path, change, config: bool = True) -> str:
    """Lightning's `.ckpt` of the real case, changed by `change(obj)`, saved with torch beside
    the run's config.json."""
    import torch

    obj = torch.load(os.path.join(FILE, "step=3.ckpt"), weights_only=False)
    change(obj)
    out = tmp_path / "step=3.ckpt"
    torch.save(obj, out)
    if config:
        shutil.copy(os.path.join(FILE, "config.json"), tmp_path / "config.json")
    return str(out)


# -- the prefix rule ------------------------------------------------------------------------------


def test_candidates_are_the_common_dotted_prefixes_longest_first():
    names = ["model.model.embed_tokens.weight", "model.lm_head.weight"]
    assert prefix.candidates(names) == ["model.", ""]
    assert prefix.candidates(["a.b.c.weight"]) == ["a.b.c.", "a.b.", "a.", ""]  # never the last part
    assert prefix.candidates(["w", "a.w"]) == [""]


def test_choose_takes_the_one_prefix_that_fits_and_refuses_two_that_differ():
    names = ["net.model.embed_tokens.weight", "net.lm_head.weight"]
    hf = {"model.embed_tokens.weight", "lm_head.weight"}

    def exact(got):
        return tuple(sorted(got)) if set(got) <= hf else None

    assert prefix.choose(names, exact, "f").prefix == "net."
    with pytest.raises(FormatError, match=r"several attribute prefixes \('net.', ''\)"):
        prefix.choose(names, lambda got: tuple(got), "f")  # anything fits: two different namings
    with pytest.raises(FormatError, match=r"no attribute prefix .*tried 'net.' -> 'model.embed_tokens.weight', ''"):
        prefix.choose(names, lambda got: None, "f")
    # two prefixes that give the same HF names (a family's alternate spelling) are one answer
    assert prefix.choose(["x.a.w", "x.a.v"], lambda got: ("same",), "f").prefix == "x.a."


def test_without_a_config_the_longest_common_prefix_is_taken_and_said(tmp_path):
    src = open_source(_variant(tmp_path, lambda o: None, config=False))
    assert src.config is None and src.trainer["attribute_prefix"] == "model."
    assert "model.embed_tokens.weight" in src.tensors and "lm_head.weight" in src.tensors
    assert any("longest common prefix 'model.'" in n and "--config" in n for n in src.notes)


def test_a_config_no_family_implements_is_kept_and_said(tmp_path):
    import json

    path = _variant(tmp_path, lambda o: None, config=False)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "hidden_size": 8}))
    src = open_source(path)
    assert src.config is None and src.trainer["hf_config"]["architectures"] == ["NoSuchForCausalLM"]
    assert src.trainer["attribute_prefix"] == "model."
    assert any("NoSuchForCausalLM: no model family implements it" in n for n in src.notes)


def test_a_name_whose_step_is_not_the_global_step_is_said(tmp_path):
    shutil.copy(os.path.join(FILE, "step=3.ckpt"), tmp_path / "step=7.ckpt")
    src = open_source(str(tmp_path / "step=7.ckpt"))
    assert src.step == 3 and any("the name says step 7, its global_step 3" in n for n in src.notes)


def test_a_family_alternate_spelling_is_not_a_second_prefix():
    """GPT-2's bare `h.0...` names are `transformer.h.0...` after the family's fixes: a module
    holding a GPT2Model as `self.transformer` fits under '' and 'transformer.', the same names."""
    from hybridckpt import models

    cfg = models.config_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8,
                                 "n_head": 2, "n_layer": 1, "n_positions": 16, "vocab_size": 32})
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight"]
    fit = prefix.family_fit(cfg)
    assert fit(names) == fit(prefix.strip(names, "transformer.")) is not None
    assert prefix.choose(names, fit, "f", "gpt2").prefix == "transformer."
    assert fit(["model.embed_tokens.weight"]) is None


def _by_name(obj: dict, param_names: bool) -> None:
    """Lightning's optimizer state as FSDPStrategy(state_dict_type="full") saves it (keyed by the
    LightningModule's names), or index-keyed with torch >= 2.6's `param_names` in its group."""
    sd = obj["optimizer_states"][0]
    names = list(obj["state_dict"])  # `model.<HF name>`, named_parameters() order
    (group,) = sd["param_groups"]
    if param_names:
        group["param_names"] = [names[i] for i in group["params"]]
    else:
        sd["state"] = {names[i]: st for i, st in sd["state"].items()}
        group["params"] = [names[i] for i in group["params"]]


@pytest.mark.parametrize("param_names", [False, True], ids=["keyed-by-name", "param_names"])
def test_an_optimizer_keyed_by_name_is_read_by_name(tmp_path, param_names):
    import json

    import numpy as np
    from safetensors.numpy import load_file

    src = open_source(_variant(tmp_path, lambda o: _by_name(o, param_names)))
    ref = load_file(os.path.join(REAL, "lightning_ckpt_index", "reference.safetensors"))
    with open(os.path.join(REAL, "lightning_ckpt_index", "manifest.json")) as f:
        names = json.load(f)["hyper"][0]["names"]
    assert src.index_optimizer is None and src.optimizer.step == 3
    assert src.optimizer.hyper["lr"] == 0.0025 and src.optimizer.groups[0]["params"] == len(names)
    for slot in ("exp_avg", "exp_avg_sq"):
        got = src.optimizer.slots[slot]
        assert sorted(got) == sorted(names)  # the attribute prefix cut from the moments too
        for n in names:
            assert np.array_equal(got[n].materialize(), ref[f"{slot}/{n}"]), (slot, n)


def test_saved_hyperparameters_of_framework_classes_are_inert(tmp_path, capsys):
    """`save_hyperparameters()` of a module built from an HF config pickles the config object:
    a stub (nothing imported or run), the checkpoint read; a class of the user's own stays refused."""
    import collections

    import transformers

    cfg = transformers.LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2)
    src = open_source(_variant(tmp_path, lambda o: o.__setitem__("hyper_parameters", {"config": cfg, "lr": 0.01})))
    assert src.format == "lightning" and src.step == 3 and "lm_head.weight" in src.tensors
    other = tmp_path / "other"
    other.mkdir()
    path = _variant(other, lambda o: o.__setitem__("hyper_parameters", {"x": collections.OrderedDict.__new__(_Mine)}))
    one_line(*cli(capsys, "inspect", path), "test_lightning._Mine", "not on the allow-list")


class _Mine(dict):
    pass


# -- detection ------------------------------------------------------------------------------------


def test_checkpoint_names_give_steps_as_modelcheckpoint_writes_them():
    from hybridckpt.formats.lightning.files import CkptNames

    n = CkptNames()
    assert [n.number(x) for x in ("step=3.ckpt", "epoch=0-step=3.ckpt", "step=3-v1.ckpt", "a_step=12.ckpt")] == [3, 3, 3, 12]
    for name in ("last.ckpt", "laststep=3.ckpt", "step=3.ckpt.tmp", "step=\u0663.ckpt".encode().decode("unicode_escape"),
                 "step=-3.ckpt", "step=" + "9" * 19 + ".ckpt", "step=3"):
        assert n.number(name) is None, name


def test_plain_torch_files_stay_torch(tmp_path):
    import torch

    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 1}, tmp_path / "wrapped.ckpt")
    assert detect(str(tmp_path / "model.pt")) == "torch"
    assert detect(str(tmp_path / "wrapped.ckpt")) == "torch"  # `state_dict` without Lightning's keys


def test_dcp_param_group_names_are_the_state_keys():
    """The DCP reader's param groups name the same fqns as its moments (it cut its model key from
    them: `model.embed_tokens.weight` for the state's `model.model.embed_tokens.weight`)."""
    opt = open_source(os.path.join(SHARDED, "step=3.ckpt"), "dcp").optimizer
    names = {p for g in opt.hyper["groups"] for p in g["params"]}
    assert names == set(opt.slots["exp_avg"]) and "model.model.embed_tokens.weight" in names


# -- hostile input: one line, exit 2 --------------------------------------------------------------


def test_state_dict_not_a_dict(tmp_path, capsys):
    path = _variant(tmp_path, lambda o: o.__setitem__("state_dict", [1, 2]))
    one_line(*cli(capsys, "inspect", path), "step=3.ckpt", "'state_dict'", "expected a state dict", "list")


def test_no_prefix_fits_the_config(tmp_path, capsys):
    import torch

    path = _variant(tmp_path, lambda o: o["state_dict"].__setitem__("model.extra_head.weight", torch.zeros(2, 2)))
    one_line(*cli(capsys, "inspect", path), "no attribute prefix", "llama", "tried 'model.'", "--format torch")


def test_prefixes_that_fit_two_ways(tmp_path, capsys, monkeypatch):
    """No shipped family has two different HF namings one state dict fits both ways; a family
    whose rules took any name would: the CLI says so in one line."""
    path = _variant(tmp_path, lambda o: None)
    monkeypatch.setattr(prefix, "family_fit", lambda cfg: lambda names: tuple(names))
    one_line(*cli(capsys, "inspect", path), "several attribute prefixes ('model.', '')", "--rules")


def test_two_optimizers_refused(tmp_path, capsys):
    path = _variant(tmp_path, lambda o: o["optimizer_states"].append(o["optimizer_states"][0]))
    one_line(*cli(capsys, "inspect", path), "holds 2 optimizers", "--format torch")


@pytest.mark.parametrize("change, must", [
    (lambda o: o["optimizer_states"][0]["state"].__setitem__("a", {}), "a parameter index"),
    (lambda o: o["optimizer_states"][0].__setitem__("state", {"a": {}}), "['param_names'][0]: expected a parameter name"),
    (lambda o: o["optimizer_states"][0]["param_groups"][0].__setitem__("params", [0, 0]), "listed twice"),
    (lambda o: o["optimizer_states"][0]["state"].__setitem__(99, {}), "no param group lists index 99"),
    (lambda o: o.__setitem__("global_step", "three"), "'global_step': expected an integer"),
    (lambda o: o.__setitem__("lr_schedulers", 7), "'lr_schedulers'"),
])
def test_damaged_lightning_entries(tmp_path, capsys, change, must):
    one_line(*cli(capsys, "inspect", _variant(tmp_path, change)), "step=3.ckpt", must)


def test_scheduler_metadata_is_bounded_json(tmp_path):
    """`lr_schedulers` is the file's to shape: kept as JSON no deeper, longer or larger than the
    bounds (`state.plain`), a tensor as its shape."""
    import json

    import torch

    from hybridckpt.formats.lightning import state

    deep: list = []
    for _ in range(30):
        deep = [deep]
    sched = {"deep": deep, "text": "x" * 100_000, "t": torch.zeros(3), "inf": float("inf"), "obj": {1: b"raw"},
             "many": list(range(100_000))}
    src = open_source(_variant(tmp_path, lambda o: o.__setitem__("lr_schedulers", [sched])))
    (got,) = src.trainer["lr_schedulers"]
    text = json.dumps(got, allow_nan=False)
    assert len(text) < 64_000 and got["text"] == "x" * state.MAX_TEXT and got["t"] == "tensor[3]"
    assert got["inf"] == "inf" and got["obj"] == {"1": "bytes"} and len(got["many"]) < state.MAX_ITEMS
    depth, node = 0, got["deep"]
    while isinstance(node, list) and node:
        depth, node = depth + 1, node[0]
    assert depth <= state.MAX_DEPTH and node == "..."


def _sharded_copy(tmp_path) -> str:
    out = tmp_path / "step=3.ckpt"
    shutil.copytree(os.path.join(SHARDED, "step=3.ckpt"), out)
    shutil.copy(os.path.join(SHARDED, "config.json"), tmp_path / "config.json")
    return str(out)


@pytest.mark.parametrize("meta, must", [
    (b"garbage, not a torch.save file", "meta.pt"),
    ("list", "meta.pt: expected a dict"),
    ("step", "meta.pt: 'global_step': expected an integer"),
])
def test_meta_pt_garbage(tmp_path, capsys, meta, must):
    import torch

    folder = _sharded_copy(tmp_path)
    path = os.path.join(folder, "meta.pt")
    if isinstance(meta, bytes):
        with open(path, "wb") as f:
            f.write(meta)
    elif meta == "list":
        torch.save([1, 2], path)
    else:
        torch.save({"global_step": [3], "epoch": 0}, path)
    assert detect(folder) == "lightning"
    one_line(*cli(capsys, "inspect", folder), must)
    assert sys.exc_info() == (None, None, None)


def test_step_from_the_cli(tmp_path, capsys):
    """`--step` on a folder of `.ckpt`: a step not there, or in two names, is one line; on one
    `.ckpt` only its own step."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    shutil.copy(os.path.join(FILE, "step=3.ckpt"), folder / "epoch=0-step=3.ckpt")
    code, err = cli(capsys, "inspect", folder, "--step", "3")
    assert code == 0, err
    one_line(*cli(capsys, "inspect", folder, "--step", "4"), "no step 4", "*step=N*.ckpt", "steps 3")
    one_line(*cli(capsys, "inspect", folder / "epoch=0-step=3.ckpt", "--step", "4"), "no step 4", "(step 3)")
    shutil.copy(os.path.join(FILE, "step=3.ckpt"), folder / "step=3-v1.ckpt")
    one_line(*cli(capsys, "inspect", folder, "--step", "3"), "step 3 is in several", "step=3-v1.ckpt")
