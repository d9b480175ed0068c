"""Values of the wrong type in a checkpoint (issue 38): one line through the CLI, never a traceback.

Each case starts from a real tool's file (tests/real/cases: an HF Trainer FSDP2 `optimizer.bin`
and a DeepSpeed ZeRO-2 `*_optim_states.pt` saved by torch, a DeepSpeed universal
`optimizer_state.pt`, OpenAI's MXFP4 GPT-OSS safetensors), loads it with the real library
(torch, safetensors), changes one value's type and saves it back the same way: `import` exits 2
with one line naming the file, the key, what was expected and what was found, and writes nothing.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from hybridckpt.cli import main
from hybridckpt.io.byte_source import close_all

CASES = os.path.join(os.path.dirname(__file__), "..", "real", "cases")


def _groups(sd):
    """The first `param_groups` list in a (nested) optimizer state dict."""
    if isinstance(sd, dict):
        if "param_groups" in sd:
            return sd["param_groups"]
        for v in sd.values():
            found = _groups(v)
            if found:
                return found
    return None


def _copy(tmp_path, case: str) -> str:
    dst = str(tmp_path / "src")
    shutil.copytree(os.path.join(CASES, case, "ckpt"), dst)
    return dst


def _edit_torch(path: str, edit) -> None:
    sd = torch.load(path, weights_only=False)
    edit(sd)
    torch.save(sd, path)


def _import_fails(tmp_path, capsys, src: str, *must: str) -> str:
    capsys.readouterr()
    code = main(["import", src, str(tmp_path / "dst")])
    close_all()
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    for m in must:
        assert m in err, (m, err)
    assert sorted(os.listdir(tmp_path)) == ["src"], err  # nothing written, nothing left
    return err


def _set(key, value):
    def edit(sd):
        for g in _groups(sd):
            g[key] = value
    return edit


GROUP_CASES = {
    "betas nested": (_set("betas", [[0.9], [0.999]]), "['betas']: expected a list of numbers, found [[0.9], [0.999]]"),
    "lr a list": (_set("lr", [0.1, 0.2]), "['lr']: expected a number, found [0.1, 0.2]"),
    "eps a string": (_set("eps", "tiny"), "['eps']: expected a number, found 'tiny'"),
    "amsgrad a string": (_set("amsgrad", "yes"), "['amsgrad']: expected true or false, found 'yes'"),
}
FILES = {  # case -> its optimizer file (glob under ckpt/)
    "fsdp": ("hf_trainer_fsdp2_full", "checkpoint-3/optimizer.bin"),
    "zero2": ("hf_trainer_deepspeed_zero2", "checkpoint-3/global_step*/*_optim_states.pt"),
    "universal": ("deepspeed_universal_zero2", "global_step3_universal/zero/optimizer_state.pt"),
}


@pytest.mark.parametrize("which", sorted(FILES))
@pytest.mark.parametrize("case", sorted(GROUP_CASES))
def test_a_param_group_value_of_the_wrong_type_is_one_line(tmp_path, capsys, which, case):
    name, pattern = FILES[which]
    src = _copy(tmp_path, name)
    path = sorted(glob.glob(os.path.join(src, pattern)))[0]  # (ZeRO: rank 0's, whose groups are read)
    edit, says = GROUP_CASES[case]
    _edit_torch(path, edit)
    _import_fails(tmp_path, capsys, src, f"{path}: param_groups[0]{says}")


def test_param_group_params_that_are_not_a_list_is_one_line(tmp_path, capsys):
    src = _copy(tmp_path, "hf_trainer_fsdp2_full")
    path = os.path.join(src, "checkpoint-3", "optimizer.bin")
    _edit_torch(path, _set("params", 5))
    _import_fails(tmp_path, capsys, src, f"{path}: param_groups[0]['params']: expected a list, found 5 (int)")


def test_zero_param_indices_that_are_lists_are_one_line(tmp_path, capsys):
    src = _copy(tmp_path, "hf_trainer_deepspeed_zero2")
    path = sorted(glob.glob(os.path.join(src, "checkpoint-3", "global_step*", "*_optim_states.pt")))[0]
    _edit_torch(path, _set("params", [[0]]))
    _import_fails(tmp_path, capsys, src, f"{path}: param_groups[..]['params']: expected parameter indices, found [[0]")


def test_a_step_of_the_wrong_type_is_one_line(tmp_path, capsys):
    """DeepSpeed's own folder (global_step3/, read as `deepspeed`): its `global_steps` is the step."""
    src = _copy(tmp_path, "hf_trainer_deepspeed_zero2")
    folder = os.path.join(src, "checkpoint-3", "global_step3")

    def edit(sd):
        sd["global_steps"] = [3]
    _edit_torch(os.path.join(folder, "mp_rank_00_model_states.pt"), edit)
    _import_fails(tmp_path, capsys, folder, f"{folder}: step: expected an integer, found [3] (list)")


@pytest.mark.parametrize(("shapes", "found"), [
    (((256, 16), (256,)), "MXFP4 blocks (256, 16) and scales (256,): expected blocks [..., rows, G, 16]"),
    (((4, 64, 1, 16), (4, 64)), "MXFP4 blocks (4, 64, 1, 16) and scales (4, 64): expected blocks [..., G, 16]"),
])
def test_mxfp4_blocks_and_scales_of_too_few_dimensions_are_one_line(tmp_path, capsys, shapes, found):
    from safetensors.torch import load_file, save_file

    src = _copy(tmp_path, "gpt_oss_mxfp4")
    (path,) = glob.glob(os.path.join(src, "*.safetensors"))
    t = load_file(path)
    name = "model.layers.0.mlp.experts.down_proj"
    t[name + "_blocks"] = t[name + "_blocks"].reshape(shapes[0])
    t[name + "_scales"] = t[name + "_scales"].reshape(shapes[1])
    save_file(t, path, {"format": "pt"})
    _import_fails(tmp_path, capsys, src, f"'{name}_blocks': {found}")


def test_the_value_helpers_name_the_key_expected_and_found():
    import numpy as np

    from hybridckpt import values
    from hybridckpt.errors import FormatError
    from hybridckpt.lazy import ArrayTensor

    assert values.number(np.float32(0.5), "f", "lr") == 0.5
    assert values.number(ArrayTensor(np.array(0.25, np.float32)), "f", "lr") == 0.25  # torch's tensor lr
    assert values.integer(3.0, "f", "step") == 3 and values.flag(np.True_, "f", "x") is True
    assert values.numbers((0.9, 0.95), "f", "betas", 2) == [0.9, 0.95]
    for call, says in [
        (lambda: values.number(True, "f", "lr"), "f: lr: expected a number, found True (bool)"),
        (lambda: values.number(10**400, "f", "lr"), "f: lr: expected a number that fits a float"),
        (lambda: values.integer(2.5, "f", "step"), "f: step: expected an integer, found 2.5 (float)"),
        (lambda: values.integer(float("inf"), "f", "step"), "f: step: expected an integer, found inf (float)"),
        (lambda: values.numbers([0.9], "f", "betas", 2), "f: betas: expected a list of 2 numbers, found [0.9] (list)"),
        (lambda: values.flag(1, "f", "amsgrad"), "f: amsgrad: expected true or false, found 1 (int)"),
        (lambda: values.mapping([], "f", "g"), "f: g: expected a dict, found [] (list)"),
    ]:
        with pytest.raises(FormatError) as e:
            call()
        assert str(e.value).startswith(says), str(e.value)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("group_paddings", [[0]], "group_paddings[0]: expected an integer, found [0] (list)"),
    ("group_paddings", 3, "group_paddings: expected a list, found 3 (int)"),
    ("param_alignment_paddings", [[[1]]], "param_alignment_paddings[0][0]: expected an integer, found [1] (list)"),
    ("single_partition_of_fp32_groups", 7, "single_partition_of_fp32_groups: expected a list, found 7 (int)"),
])
def test_zero_partition_fields_of_the_wrong_type_are_one_line(tmp_path, capsys, key, value, says):
    src = _copy(tmp_path, "hf_trainer_deepspeed_zero2")
    path = sorted(glob.glob(os.path.join(src, "checkpoint-3", "global_step*", "*_optim_states.pt")))[0]

    def edit(sd):
        sd["optimizer_state_dict"][key] = value
    _edit_torch(path, edit)
    _import_fails(tmp_path, capsys, src, f"{path}: {says}")


def test_megatron_betas_nested_are_one_line(tmp_path, capsys, monkeypatch):
    """Megatron-LM's legacy save (model_optim_rng.pt, torch.save'd by the test's writer): betas
    nested as lists were dropped without a word; now the file and key are named."""
    from fixtures import megatron_writer as mw

    real = mw._torch_optimizer

    def hostile(*args, **kwargs):
        out = real(*args, **kwargs)
        for g in _groups(out):
            g["betas"] = [[0.9], [0.95]]
        return out

    monkeypatch.setattr(mw, "_torch_optimizer", hostile)
    src = str(tmp_path / "src")
    mw.write_megatron(src, mw.make_llama())
    _import_fails(tmp_path, capsys, src, "model_optim_rng.pt: optimizer param_groups[0]['betas']: expected a list of "
                  "numbers, found [[0.9], [0.95]]")


def test_a_paddle_beta_pow_accumulator_of_no_element_is_one_line(tmp_path, capsys):
    """PaddleNLP's own unified save (safetensors): a `beta1_pow_acc` of shape [0] (an IndexError
    when its one value was read) is named with its file and key."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(os.path.join(CASES, "paddlenlp_untied_fp32_1rank", "ckpt", "unified"), tmp_path / "src")
    src = str(tmp_path / "src" / "checkpoint-3")
    path = os.path.join(src, "optimizer-00001-of-00001.safetensors")
    t = load_file(path)
    key = "llama.embed_tokens.weight/beta1_pow_acc_0"
    t[key] = np.zeros((0,), np.float32)
    save_file(t, path, {"format": "np"})
    _import_fails(tmp_path, capsys, src, f"{key!r}: scalar should hold one number, but it is declared float32 [0] (0 elements)")


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_our_store_with_betas_nested_in_its_trainer_state_is_one_line_on_export(tmp_path, capsys, to):
    """Our own store is a source like any other: its recorded `optimizer_hyper` is typed too."""
    import json

    src = _copy(tmp_path, "hf_trainer_fsdp2_full")
    store = tmp_path / "store"
    assert main(["import", src, str(store)]) == 0
    (meta,) = glob.glob(str(store / "*" / "trainer_state" / "metadata"))
    with open(meta) as f:
        state = json.load(f)
    assert state["optimizer_hyper"]["betas"] == [0.9, 0.95]  # the real run's, as imported
    state["optimizer_hyper"]["betas"] = [[0.9], [0.95]]
    with open(meta, "w") as f:
        json.dump(state, f)
    capsys.readouterr()
    code = main(["export", str(store), str(tmp_path / "out"), "--to", to, "--optimizer"])
    close_all()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{store}: optimizer hyper-parameter 'betas': expected a list of numbers, found [[0.9], [0.95]]" in err
    assert not os.path.exists(tmp_path / "out")


def test_our_store_with_adam_betas_nested_is_one_line_on_a_paddle_export(tmp_path, capsys):
    """The betas a Paddle export writes its beta pows from (`adam_betas`, kept by the import of
    PaddleNLP's own unified save): nested, they were a float() traceback mid-export."""
    import json

    store = tmp_path / "store"
    src = os.path.join(CASES, "paddlenlp_untied_fp32_1rank", "ckpt", "unified", "checkpoint-3")
    assert main(["import", src, str(store)]) == 0
    (meta,) = glob.glob(str(store / "*" / "trainer_state" / "metadata"))
    with open(meta) as f:
        state = json.load(f)
    assert state["adam_betas"] == [0.9, 0.95]
    state["adam_betas"] = [[0.9], [0.95]]
    with open(meta, "w") as f:
        json.dump(state, f)
    capsys.readouterr()
    code = main(["export", str(store), str(tmp_path / "out"), "--to", "paddlenlp-unified", "--optimizer"])
    close_all()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{store}: trainer state 'adam_betas': expected a list of numbers, found [[0.9], [0.95]]" in err
    assert sorted(os.listdir(tmp_path)) == ["store"]


@pytest.mark.parametrize(("rel", "key", "value", "says"), [
    ("mp_rank_00_model_states.pt", "module", [1], "module: expected a dict, found [1] (list)"),
    ("mp_rank_00_model_states.pt", "buffer_names", 5, "buffer_names: expected a list, found 5 (int)"),
    ("mp_rank_00_model_states.pt", "buffer_names", [["b"]], "buffer_names: expected a list of names, found [['b']]"),
    ("mp_rank_00_model_states.pt", "shared_params", [1], "shared_params: expected a dict, found [1] (list)"),
    ("mp_rank_00_model_states.pt", "shared_params", {"lm_head.weight": ["x"]},
     "shared_params: expected a list of names, found ['lm_head.weight', ['x']]"),
    ("mp_rank_00_model_states.pt", "frozen_param_shapes", [(8,)], "frozen_param_shapes: expected a dict, found [(8,)]"),
    ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "optimizer_state_dict", 5,
     "optimizer_state_dict: expected a dict, found 5 (int)"),
])
def test_zero_model_and_optim_fields_of_the_wrong_type_are_one_line(tmp_path, capsys, rel, key, value, says):
    """Found by the fuzz target 'DeepSpeed ZeRO-2 model_states' / 'optim_states'
    (tests/attacks/fuzz_trees.py): each was an AttributeError or TypeError before."""
    src = _copy(tmp_path, "hf_trainer_deepspeed_zero2")
    path = os.path.join(src, "checkpoint-3", "global_step3", rel)

    def edit(sd):
        sd[key] = value
    _edit_torch(path, edit)
    _import_fails(tmp_path, capsys, src, f"{path}: {says}")
