"""`export --to hf --optimizer --optimizer-layout trainer` (issue 40, export side): the folder the
HF Trainer resumes from, checked with transformers' and torch's own code.

The source is the Trainer's own state after step 3 of `hf_trainer_index` (its parameters and
AdamW moments by name, `reference.safetensors`, written by the Trainer's run) in our HF layout,
and the torchtitan run `torchtitan_llama3` (one group, its moments from its DCP files). The check
does what `Trainer.train(resume_from_checkpoint=OUT)` does on one CPU process (transformers 5.24
trainer.py: `_load_from_checkpoint`, `create_optimizer`, `_load_optimizer_and_scheduler`,
`TrainerState.load_from_json`) with the same functions: the model from OUT's safetensors, the
optimizer as `create_optimizer` builds it (`Trainer.get_decay_parameter_names`, the default
`adamw_torch_fused`), `load_state_dict(torch.load(optimizer.pt, weights_only=True))`, the
default linear schedule's `load_state_dict`; then the moments are compared bitwise per parameter
NAME and the next step, with the gradient the run's fourth step consumed, is compared bitwise
with the run's own fourth step. The `Trainer` object itself needs accelerate, which this venv
does not hold: `generators/_trainer_check_export.py` ran `Trainer.train(resume_from_checkpoint=)`
on our export in the generator's side venv; its record (export_checks/) is checked here against
the files this code writes.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from cases import case_dir, ckpt, manifest, reference
from generators._trainer_check_export import digests, source_folder

from hybridckpt.errors import CheckpointError, ConfigError, FormatError
from hybridckpt.formats.hf.write import write_hf
from hybridckpt.formats.trainer import write as trainer_write
from hybridckpt.jobs.export import export_checkpoint
from hybridckpt.lazy import ArrayTensor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASE = "hf_trainer_index"
SLOTS = ("exp_avg", "exp_avg_sq")


def _trainer_source(tmp_path) -> str:
    """hf_trainer_index's state after step 3 (the Trainer's runtime values) as our HF export."""
    src = str(tmp_path / "src")
    source_folder(src)
    return src


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(source, our export of it with --optimizer-layout trainer, its summary): made once."""
    tmp = tmp_path_factory.mktemp("trainer")
    src, out = _trainer_source(tmp), str(tmp / "out")
    return src, out, export_checkpoint(src, out, optimizer=True, options={"optimizer_layout": "trainer"})


def _resume(out: str, weight_decay: float):
    """What the Trainer holds after resuming from `out`: (model, optimizer, scheduler, state)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, get_linear_schedule_with_warmup
    from transformers.trainer_callback import TrainerState

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(out))
    model.load_state_dict(load_file(os.path.join(out, "model.safetensors")), strict=False)  # _load_from_checkpoint
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.01, fused=True)  # create_optimizer, optim="adamw_torch_fused"
    sched = get_linear_schedule_with_warmup(opt, 0, 4)
    opt.load_state_dict(torch.load(os.path.join(out, "optimizer.pt"), map_location="cpu", weights_only=True))
    sched.load_state_dict(torch.load(os.path.join(out, "scheduler.pt"), weights_only=True))
    state = TrainerState.load_from_json(os.path.join(out, "trainer_state.json"))
    return model, opt, sched, state


def _moment_mismatches(model, opt, ref: dict) -> list[str]:
    return [f"{n}.{s}" for n, p in model.named_parameters() for s in SLOTS
            if not np.array_equal(opt.state[p][s].numpy(), ref[f"{s}/{n}"])]


def test_the_trainer_resumes_our_export_with_the_runs_moments_and_steps_as_the_run(exported):
    _, out, s = exported
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json", "model.safetensors"} <= set(s.files)
    assert not any(f.startswith("optimizer") and f.endswith(".safetensors") for f in s.files)
    ref = reference(CASE)
    model, opt, sched, state = _resume(out, 0.1)
    assert _moment_mismatches(model, opt, ref) == []
    assert state.global_step == 3 and [float(opt.state[p]["step"]) for p in model.parameters()] == [3.0] * 21
    assert [g["lr"] for g in opt.param_groups] == [0.0025] * 2 and sched.last_epoch == 3
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for n, p in model.named_parameters():
        assert np.array_equal(p.detach().numpy(), ref[f"param/{n}"]), n
        p.grad = torch.from_numpy(ref[f"grad/{n}"].copy())
    opt.step()
    sched.step()
    wrong = [n for n, p in model.named_parameters() if not np.array_equal(p.detach().numpy(), ref[f"param_next/{n}"])]
    assert wrong == []  # the run's own fourth step, bitwise
    assert sched.get_last_lr() == [0.0, 0.0]  # the linear schedule at step 4 of 4


def test_our_optimizer_pt_is_the_trainers_own_file(exported, tmp_path):
    """The Trainer's save of the same state and ours: the same bytes (the serialization id
    included), and torch.save of what torch.load gives back from ours: ours."""
    out = exported[1]
    ours = open(os.path.join(out, "optimizer.pt"), "rb").read()
    theirs = open(ckpt(CASE, "checkpoint-3", "optimizer.pt"), "rb").read()
    assert ours == theirs
    again = str(tmp_path / "again" / "optimizer.pt")
    os.makedirs(os.path.dirname(again))
    torch.save(torch.load(os.path.join(out, "optimizer.pt"), weights_only=True), again)
    assert open(again, "rb").read() == ours
    sched = torch.load(os.path.join(out, "scheduler.pt"), weights_only=True)
    assert sched == torch.load(ckpt(CASE, "checkpoint-3", "scheduler.pt"), weights_only=True)


def test_a_wrong_order_or_swapped_groups_are_caught(exported, tmp_path, monkeypatch):
    """The checks can fail: q_proj of layers 0 and 1 swapped (same shapes: torch loads it without a
    word) gives those moments to the wrong parameters; the groups swapped, torch refuses."""
    import dataclasses

    src, ref = exported[0], reference(CASE)
    real = trainer_write.parameter_order

    def swapped(cfg, names):
        found = real(cfg, names)
        order = list(found.names)
        a, b = (order.index(f"model.layers.{i}.self_attn.q_proj.weight") for i in (0, 1))
        order[a], order[b] = order[b], order[a]
        return dataclasses.replace(found, names=tuple(order))

    monkeypatch.setattr(trainer_write, "parameter_order", swapped)
    export_checkpoint(src, str(tmp_path / "o1"), optimizer=True, options={"optimizer_layout": "trainer"})
    model, opt, _, _ = _resume(str(tmp_path / "o1"), 0.1)
    assert sorted(_moment_mismatches(model, opt, ref)) == sorted(
        f"model.layers.{i}.self_attn.q_proj.weight.{s}" for i in (0, 1) for s in SLOTS)
    monkeypatch.setattr(trainer_write, "parameter_order", real)
    monkeypatch.setattr(trainer_write, "trainer_groups", lambda names, ln=(): reversed_groups(names))
    export_checkpoint(src, str(tmp_path / "o2"), optimizer=True, options={"optimizer_layout": "trainer"})
    with pytest.raises(ValueError, match="doesn't match the size"):
        _resume(str(tmp_path / "o2"), 0.1)


def reversed_groups(names):
    from hybridckpt.optim.trainer_groups import trainer_groups

    decay, rest = trainer_groups(names)
    return rest, decay


FAMILIES = {  # family: (transformers config, model, extra config) of a tiny model
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 4}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 4}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0, "eos_token_id": 1}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 1}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"tie_word_embeddings": False, "pad_token_id": 0}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"use_bias": True}),  # (its norms after the MLP)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    # (a wrapper: the text sizes in `text_config`; the module's names `model.language_model.*`)
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", {"vision_config": {
        "model_type": "pixtral", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "patch_size": 4, "image_size": 16}, "multimodal_projector_bias": True}),
    # (its SigLIP tower's LayerNorms `layer_norm1`/`layer_norm2`/`post_layernorm`: no name pattern of
    # the Trainer's catches the first two; the family declares them)
    "gemma3_mm": ("Gemma3Config", "Gemma3ForConditionalGeneration", {"vision_config": {
        "model_type": "siglip_vision_model", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "patch_size": 4, "image_size": 16}, "mm_tokens_per_image": 16}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_order_is_transformers_named_parameters_or_refused(family):
    """Each family: transformers 5.24's own module's `named_parameters()` (built on the meta
    device) from its names in any order; Mixtral's module holds its experts fused, so the
    per-expert names of its files (what an export holds) are refused rather than guessed."""
    from hybridckpt.models import config_from_hf, fit_to_hf_names

    config_cls, model_cls, extra = FAMILIES[family]
    text = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)  # fmt: skip
    kwargs = {"text_config": text, **extra} if "vision_config" in extra else {**text, **extra}
    hf_cfg = getattr(transformers, config_cls)(**kwargs)
    with torch.device("meta"):
        want = [n for n, _ in getattr(transformers, model_cls)(hf_cfg).named_parameters()]
    cfg = fit_to_hf_names(config_from_hf(hf_cfg.to_dict() | {"architectures": [model_cls]}), want)
    assert trainer_write.named_parameters_order(cfg, sorted(want)) == want
    assert trainer_write.named_parameters_order(cfg, want[::-1]) == want
    # the two groups the export writes are the Trainer's own (`get_decay_parameter_names`' rule:
    # its name patterns and the params of `nn.LayerNorm` modules)
    from transformers.trainer_pt_utils import get_parameter_names

    from hybridckpt.optim.trainer_groups import FORBIDDEN, trainer_groups

    with torch.device("meta"):
        decayed = set(get_parameter_names(getattr(transformers, model_cls)(hf_cfg), [torch.nn.LayerNorm], list(FORBIDDEN)))
    found = trainer_write.parameter_order(cfg, want)
    assert trainer_groups(list(found.names), found.layernorms)[0] == [n for n in want if n in decayed]
    if family == "mixtral":
        from hybridckpt.naming import model_hf_shapes

        with pytest.raises(CheckpointError, match="named_parameters"):
            trainer_write.named_parameters_order(cfg, list(model_hf_shapes(cfg)))


def test_the_order_is_named_parameters_order():
    """`named_parameters_order` of the model's names in any order: transformers' module order
    (the manifest's record of `LlamaForCausalLM.named_parameters()`)."""
    from hybridckpt.jobs.open import open_checkpoint

    want = manifest(CASE)["named_parameters"]
    cfg = open_checkpoint(ckpt(CASE), "auto").config
    assert trainer_write.named_parameters_order(cfg, sorted(want)) == want
    assert trainer_write.named_parameters_order(cfg, want[::-1]) == want


def test_torchtitans_moments_land_on_the_trainers_parameters(tmp_path):
    """A torchtitan run (one group, every parameter decayed) exported for the Trainer: its moments
    on the Trainer's parameters by name, its norms in the no-decay group (said in a note)."""
    case = "torchtitan_llama3"
    out = str(tmp_path / "out")
    s = export_checkpoint(ckpt(case), out, config=os.path.join(case_dir(case), "config.json"), optimizer=True,
                          options={"optimizer_layout": "trainer"})
    assert any("no-decay group" in n for n in s.notes)
    model, opt, sched, state = _resume(out, 0.1)
    assert _moment_mismatches(model, opt, reference(case)) == []
    assert state.global_step == 3 and sched.last_epoch == 3
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.95)] * 2


@pytest.mark.parametrize("flags, error", [
    ({"to": "dcp"}, "only for --to hf"),
    ({"optimizer": False}, "only with --optimizer"),
    ({"options": {"optimizer_layout": "deepspeed"}}, "expected one of safetensors, trainer"),
])
def test_the_flag_is_refused_where_it_cannot_be_honoured(tmp_path, flags, error):
    kw = {"optimizer": True, "options": {"optimizer_layout": "trainer"}, **flags}
    with pytest.raises(ConfigError, match=error):
        export_checkpoint(ckpt(CASE), str(tmp_path / "out"), **kw)
    assert os.listdir(tmp_path) == []


def test_a_source_without_the_hyper_parameters_is_refused_before_anything_is_written(tmp_path):
    ref, names = reference(CASE), manifest(CASE)["named_parameters"]
    with open(ckpt(CASE, "checkpoint-3", "config.json")) as f:
        config = json.load(f)
    src = str(tmp_path / "src")
    write_hf(src, {n: ArrayTensor(ref[f"param/{n}"]) for n in names}, config,
             slots={s: {n: ArrayTensor(ref[f"{s}/{n}"]) for n in names} for s in SLOTS}, step=3,
             trainer={"step": 3, "optimizer_name": "adamw", "optimizer": {"lr": 0.0025, "betas": [0.9, 0.999]}})
    with pytest.raises(CheckpointError, match="records no eps/weight_decay"):
        export_checkpoint(src, str(tmp_path / "out"), optimizer=True, options={"optimizer_layout": "trainer"})
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_the_trainer_itself_resumed_ours(exported):
    """The recorded run of generators/_trainer_check_export.py: transformers 5.24's Trainer resumed
    these very files (their SHA-256) with the run's moments, and its next step was the run's."""
    with open(os.path.join(os.path.dirname(case_dir(CASE)), "..", "export_checks",
                           "hf_trainer_index_trainer_resume.json")) as f:
        doc = json.load(f)
    assert doc["ok"] and doc["versions"]["transformers"] == "5.24.0", doc["lines"]
    for kind in ("param", "exp_avg", "exp_avg_sq", "grad", "param_next"):
        assert f"{kind}: 21/21 bitwise the run's" in doc["lines"]
    assert digests(exported[1]) == doc["files"]  # (a change to what we write needs the check run again)


def _config():
    from hybridckpt.models import config_from_hf

    with open(ckpt(CASE, "checkpoint-3", "config.json")) as f:
        return config_from_hf(json.load(f))


HYPER = {"lr": 0.5, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.1}
NORM, Q = "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"


def _plan():
    return trainer_write.plan(_config(), [NORM, Q], HYPER, 7, "adamw")


def test_trainer_state_takes_a_trainer_sources_fields_and_refuses_what_the_trainer_cannot_use():
    """A Trainer source's recorded fields (numbers, or numbers as text, as the trainer reader
    keeps them) are carried; a bool, a negative, NaN, text or an interval of 0 falls back to the
    default, and the note names what the resumed run acts on that was defaulted."""
    src = {"trainer_state.train_batch_size": "2", "trainer_state.logging_steps": 1, "trainer_state.epoch": "0.1875",
           "trainer_state.save_steps": 0, "trainer_state.eval_steps": True, "trainer_state.max_steps": float("nan"),
           "trainer_state.total_flos": "x", "trainer_state.num_train_epochs": 10**400}
    st = trainer_write.trainer_state(_plan(), src)
    assert (st["global_step"], st["train_batch_size"], st["logging_steps"], st["epoch"]) == (7, 2, 1, 0.1875)
    assert (st["save_steps"], st["eval_steps"], st["max_steps"], st["total_flos"]) == (500, 500, 0, 0)
    assert st["num_train_epochs"] == 0
    (note,) = trainer_write.state_note(src)
    assert "eval_steps 500, save_steps 500:" in note and "train_batch_size" not in note
    whole = {f"trainer_state.{k}": 4 for k in trainer_write.ACTED_ON}
    assert trainer_write.state_note(whole) == ()


@pytest.mark.parametrize("hyper, name, step, error", [
    (HYPER, "sgd", 3, "optimizer is 'sgd'"),
    (HYPER, "adamw", None, "records no step"),
    ({**HYPER, "eps": None}, "adamw", 3, "records no eps"),
    ({**HYPER, "betas": [0.9]}, "adamw", 3, "betas is \\[0.9\\]; expected two"),
    ({**HYPER, "amsgrad": True}, "adamw", 3, "amsgrad on"),
])
def test_what_the_trainer_would_resume_wrongly_is_refused(hyper, name, step, error):
    with pytest.raises(CheckpointError, match=error):
        trainer_write.plan(_config(), [Q], hyper, step, name)
    with pytest.raises(CheckpointError, match="no model config \\(give --config\\)"):
        trainer_write.plan(None, [Q], HYPER, 3, "adamw")


@pytest.mark.parametrize("key, value, expected", [
    ("lr", "0.1", "a number"), ("betas", ["0.9", 0.99], "a list of numbers"), ("fused", "yes", "true or false"),
    ("weight_decay", True, "a number"), ("initial_lr", [1], "a number"), ("amsgrad", 1, "true or false"),
])
def test_a_hyper_parameter_of_the_wrong_type_is_one_line_naming_it(key, value, expected):
    """The hyper-parameters come from the source's files: a string where a number belongs is a
    FormatError naming the key and what was found, never a traceback or a pickled string."""
    with pytest.raises(FormatError, match=f"{key}: expected {expected}, found"):
        trainer_write.plan(_config(), [Q], {**HYPER, key: value}, 3, "adamw")


def test_a_parameter_without_its_moments_is_refused():
    p = _plan()
    slots = {"exp_avg": {n: ArrayTensor(np.zeros(2, np.float32)) for n in p.order},
             "exp_avg_sq": {Q: ArrayTensor(np.zeros(2, np.float32))}}
    with pytest.raises(CheckpointError, match=f"no exp_avg_sq for {NORM} \\(1 parameter"):
        trainer_write.check(p, slots)
    assert (p.decay, p.no_decay) == ((Q,), (NORM,))


@pytest.mark.parametrize("args, must", [
    (["--optimizer-layout", "trainer"], "only with --optimizer"),
    (["--optimizer", "--optimizer-layout", "trainer", "--to", "torchtitan"], "only for --to hf (not --to torchtitan)"),
])
def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, capsys, args, must):
    from hybridckpt.cli import main
    from hybridckpt.io.byte_source import close_all

    capsys.readouterr()
    code = main(["export", ckpt(CASE), str(tmp_path / "out"), *args])
    close_all()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("hybridckpt: error:") and must in err, err
    assert os.listdir(tmp_path) == []


def test_the_cli_writes_the_trainer_layout(tmp_path, capsys):
    from hybridckpt.cli import main

    case = "torchtitan_llama3"
    code = main(["export", ckpt(case), str(tmp_path / "out"), "--config", os.path.join(case_dir(case), "config.json"),
                 "--optimizer", "--optimizer-layout", "trainer", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "optimizer.pt, scheduler.pt, trainer_state.json" in out and "note: trainer_state.json:" in out
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith("optimizer") and f.endswith(".safetensors")]


def test_through_our_orbax_store_the_trainers_own_file_comes_back(exported, tmp_path, capsys):
    """The run moved into JAX (import: our Orbax store, layers stacked) and exported for the
    Trainer: its optimizer.pt is the Trainer's own, byte for byte."""
    from hybridckpt.cli import main

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    assert main(["import", exported[0], store, "--quiet"]) == 0
    assert main(["export", store, out, "--optimizer", "--optimizer-layout", "trainer", "--quiet"]) == 0
    with open(os.path.join(out, "optimizer.pt"), "rb") as a, open(ckpt(CASE, "checkpoint-3", "optimizer.pt"), "rb") as b:
        assert a.read() == b.read()


def test_a_failure_while_writing_leaves_nothing(exported, tmp_path, monkeypatch):
    """optimizer.pt half written when the write fails: no OUT, nothing beside it."""
    from hybridckpt.containers import torch_save_many

    src = exported[0]
    real = torch_save_many._stream
    calls = []

    def failing(out, t, crc):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        real(out, t, crc)

    monkeypatch.setattr(torch_save_many, "_stream", failing)
    with pytest.raises(Exception, match="No space left"):
        export_checkpoint(src, str(tmp_path / "out"), optimizer=True, options={"optimizer_layout": "trainer"})
    assert os.listdir(tmp_path) == [] and len(calls) == 5


@pytest.mark.parametrize("groups, note", [
    ([{"weight_decay": 0.1, "params": [Q]}, {"weight_decay": 0.0, "params": [NORM]}], None),
    ([{"weight_decay": 0.1, "params": [Q, NORM]}], f"decay 1 parameter(s) otherwise than the Trainer's rule ({NORM}"),
    ([{"weight_decay": 0.0, "params": [Q, NORM]}], f"decay 1 parameter(s) otherwise than the Trainer's rule ({Q}"),
])
def test_a_source_grouped_otherwise_is_said(groups, note):
    p = trainer_write.plan(_config(), [NORM, Q], {**HYPER, "groups": groups}, 3, "adamw")
    assert (p.decay, p.no_decay) == ((Q,), (NORM,))
    assert [n for n in p.notes if note in n] if note else p.notes == ()


@pytest.mark.parametrize("groups, expected", [
    ("x", "groups: expected a list"), ([7], "group 0: expected a dict"),
    ([{"weight_decay": "0.1", "params": [Q]}], "group 0 weight_decay: expected a number"),
    ([{"weight_decay": 0.1, "params": 5}], "group 0 params: expected a list"),
])
def test_hostile_source_groups_are_one_line(groups, expected):
    with pytest.raises(FormatError, match=expected):
        trainer_write.plan(_config(), [NORM, Q], {**HYPER, "groups": groups}, 3, "adamw")


def test_each_moment_is_read_once_ahead_of_the_writer(tmp_path):
    """The moments are read ahead by the reader pool in the order optimizer.pt takes them: each
    read once (a view consumed out of order would be read a second time), values as given."""
    import threading

    reads: dict[str, int] = {}
    on_main: list[str] = []

    class Counted(ArrayTensor):
        def __init__(self, name, array):
            super().__init__(array)
            self.name = name

        def count(self):
            reads[self.name] = reads.get(self.name, 0) + 1
            if threading.current_thread() is threading.main_thread():
                on_main.append(self.name)

        def read_box(self, box):
            self.count()
            return super().read_box(box)

        def read_into(self, box, out):
            self.count()
            super().read_into(box, out)

    p = _plan()
    rng = np.random.default_rng(0)
    arrays = {(s, n): rng.standard_normal((3, 4)).astype(np.float32) for s in SLOTS for n in p.order}
    slots = {s: {n: Counted(f"{n}.{s}", arrays[s, n]) for n in p.order} for s in SLOTS}
    trainer_write.write_files(str(tmp_path), p, slots, {}, direct_io=False)
    assert reads == {f"{n}.{s}": 1 for s, n in arrays}
    assert on_main == [f"{p.order[0]}.exp_avg"]  # the first (nothing ahead of it yet); the rest by the pool
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)["state"]
    assert all(np.array_equal(state[i][s].numpy(), arrays[s, n]) for i, n in enumerate(p.order) for s in SLOTS)
