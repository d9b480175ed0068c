"""`--step` on every source that holds several steps (issue 37): torchtitan `step-N/`, Trainer
`checkpoint-N/`, Megatron `iter_N/` (torch and torch_dist), DeepSpeed `global_stepN/`,
PaddleFormers `checkpoint-N/`, MaxText `N/`, and ours.

Each source is written by the real tool where one runs here (torch DCP, torch.save, safetensors,
DeepSpeed's own files from tests/real/cases re-saved with other values by torch) or by the
project's writers that follow the tool's code (Megatron, PaddleFormers). Every case holds two
steps of DIFFERENT values: the earlier step asked for gives the earlier step's values bit for
bit (as its own folder, opened alone, gives them), the default is the documented one, an absent
step is one line listing the steps, and a later step with every file truncated does not matter.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import numpy as np
import pytest

from hybridckpt.cli import main
from hybridckpt.errors import FormatError
from hybridckpt.io.step_folders import MAX_DIGITS, StepPattern, listing
from hybridckpt.jobs.open import open_checkpoint

REAL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "real", "cases")


@dataclass
class Case:
    """A folder of two steps: `folders[step]` is each step's own folder; `default` the step read
    when none is asked for."""

    fmt: str
    root: str
    folders: dict[int, str]
    default: int
    config: str | None = None
    absent: int = 4
    extra: dict = field(default_factory=dict)

    @property
    def early(self) -> int:
        return min(self.folders)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _values(opened) -> dict[str, np.ndarray]:
    """Every param and optimizer slot tensor of `opened`, read whole."""
    out = {k: np.asarray(t.materialize()) for k, t in opened.named.params.items()}
    for slot, tensors in opened.named.slots.items():
        out |= {f"{k} [{slot}]": np.asarray(t.materialize()) for k, t in tensors.items()}
    return out


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def _truncate_all(folder: str) -> int:
    """Cut every file below `folder` to half its size (a crash mid-save, a bad copy)."""
    n = 0
    for r, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(r, f)
            os.truncate(p, os.path.getsize(p) // 2)
            n += 1
    return n


# -- the sources ----------------------------------------------------------------------------------


def _titan(tmp_path) -> Case:
    """torchtitan's CheckpointManager folder, written by torch's DCP: step-1/ and step-3/."""
    from fixtures.titan_writer import STEPS, write_titan

    paths = write_titan(str(tmp_path / "titan"), "llama3", seed=3)
    root = paths["checkpoint"]
    return Case("dcp", root, {1: os.path.join(root, "step-1"), STEPS: paths["step"]}, STEPS,
                config=os.path.join(paths["hf"], "config.json"))


def _trainer(tmp_path) -> Case:
    """An HF Trainer output folder, checkpoint-2/ and checkpoint-4/ of one run: model.safetensors
    (safetensors), optimizer.pt (torch.save of torch's AdamW state), trainer_state.json."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    root = tmp_path / "trainer"
    folders = {}
    for step in range(1, 5):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        if step in (2, 4):
            folder = root / f"checkpoint-{step}"
            folder.mkdir(parents=True)
            save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(folder / "model.safetensors"))
            torch.save(opt.state_dict(), str(folder / "optimizer.pt"))
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
            folders[step] = str(folder)
    return Case("hf-trainer", str(root), folders, 4, absent=3)


def _resaved(src: str, dst: str, *, add: float, step: int) -> None:
    """`src` (a torch.save file) loaded by torch, every floating tensor plus `add`, its
    `global_steps` set to `step`, saved again by torch at `dst`."""
    import torch

    def shift(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x + add
        if isinstance(x, dict):
            return {k: step if k == "global_steps" else shift(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(shift(v) for v in x)
        return x

    torch.save(shift(torch.load(src, weights_only=False, map_location="cpu")), dst)


def _deepspeed(tmp_path) -> Case:
    """A DeepSpeed save folder: global_step3/ as DeepSpeed wrote it (tests/real/cases) and
    global_step5/, the same files re-saved by torch with other values; `latest` names step 5."""
    real = os.path.join(REAL, "hf_trainer_deepspeed_zero2", "ckpt", "checkpoint-3", "global_step3")
    root = tmp_path / "ds"
    shutil.copytree(real, root / "global_step3")
    (root / "global_step5").mkdir()
    for f in os.listdir(real):
        _resaved(os.path.join(real, f), str(root / "global_step5" / f), add=0.25, step=5)
    (root / "latest").write_text("global_step5")
    return Case("deepspeed", str(root), {3: str(root / "global_step3"), 5: str(root / "global_step5")}, 5)


def _trainer_deepspeed(tmp_path) -> Case:
    """An HF Trainer + DeepSpeed output folder: checkpoint-3/ as the Trainer wrote it
    (tests/real/cases) and checkpoint-5/, its copy with the DeepSpeed files re-saved by torch with
    other values (`global_step5/`, `latest`, trainer_state.json's global_step 5)."""
    real = os.path.join(REAL, "hf_trainer_deepspeed_zero2", "ckpt", "checkpoint-3")
    root = tmp_path / "trainer_ds"
    shutil.copytree(real, root / "checkpoint-3")
    later = root / "checkpoint-5"
    shutil.copytree(real, later, ignore=shutil.ignore_patterns("global_step3"))
    (later / "global_step5").mkdir()
    for f in os.listdir(os.path.join(real, "global_step3")):
        _resaved(os.path.join(real, "global_step3", f), str(later / "global_step5" / f), add=0.25, step=5)
    (later / "latest").write_text("global_step5")
    state = json.loads((later / "trainer_state.json").read_text())
    (later / "trainer_state.json").write_text(json.dumps({**state, "global_step": 5}))
    return Case("hf-trainer", str(root), {3: str(root / "checkpoint-3"), 5: str(later)}, 5)


def _universal(tmp_path) -> Case:
    """A DeepSpeed universal save folder: global_step3_universal/ as ds_to_universal wrote it
    (tests/real/cases) and global_step5_universal/, every `.pt` re-saved by torch with other
    values; `latest_universal` names step 5."""
    real = os.path.join(REAL, "deepspeed_universal_zero2", "ckpt", "global_step3_universal")
    root = tmp_path / "universal"
    shutil.copytree(real, root / "global_step3_universal")
    later = root / "global_step5_universal"
    for r, _, files in os.walk(real):
        os.makedirs(later / os.path.relpath(r, real), exist_ok=True)
        for f in files:
            dst = str(later / os.path.relpath(os.path.join(r, f), real))
            if f.endswith(".pt"):
                _resaved(os.path.join(r, f), dst, add=0.25, step=5)
            else:
                shutil.copy(os.path.join(r, f), dst)
    (root / "latest_universal").write_text("global_step5_universal")
    return Case("deepspeed-universal", str(root), {3: str(root / "global_step3_universal"), 5: str(later)}, 5)


def _megatron(tmp_path) -> Case:
    """A Megatron-LM save folder (torch format): iter_0000002/, iter_0000006/ and the tracker
    naming 6, two models' values."""
    from fixtures.megatron_writer import make_llama, write_megatron

    root = str(tmp_path / "meg")
    for it, seed in ((2, 1), (6, 2)):
        write_megatron(root, make_llama(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=100, seed=seed),
                       iteration=it)
    return Case("megatron", root, {it: os.path.join(root, f"iter_{it:07d}") for it in (2, 6)}, 6)


def _megatron_dist(tmp_path) -> Case:
    """A Megatron-LM torch_dist save folder (torch's DCP writer): iter_0000002/, iter_0000006/."""
    from fixtures.megatron_dist_writer import write_torch_dist
    from fixtures.megatron_writer import make_llama

    root = str(tmp_path / "megdist")
    folders = {}
    for it, seed in ((2, 1), (6, 2)):
        ref = make_llama(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=100, seed=seed)
        folders[it] = write_torch_dist(root, ref, iteration=it)
    return Case("megatron-dist", root, folders, 6)


def _flex(tmp_path) -> Case:
    """A PaddleFormers output folder of FlexCheckpoints: checkpoint-3/, checkpoint-5/."""
    from fixtures import flex_writer as fw
    from fixtures import paddle_writer as pw

    root = str(tmp_path / "flex")
    folders = {}
    for step, seed in ((3, 0), (5, 1)):
        folders[step], _ = fw.write_output_folder(root, pw.reference_llama(seed), fw.Options(), step=step)
    return Case("flex-checkpoint", root, folders, 5)


def _maxtext(tmp_path) -> Case:
    """A MaxText run folder: 1/items and 3/items, the torchtitan steps exported as MaxText's
    train state (`export --to maxtext`: OUT/<step>/items), moved under one root."""
    from hybridckpt.jobs import export_checkpoint

    titan = _titan(tmp_path)
    root = tmp_path / "maxtext"
    for step, folder in titan.folders.items():
        out = tmp_path / f"mt{step}"
        export_checkpoint(folder, str(out), to="maxtext", config=titan.config, optimizer=True)
        os.makedirs(root, exist_ok=True)
        os.rename(out / str(step), root / str(step))
    return Case("maxtext", str(root), {s: str(root / str(s)) for s in titan.folders}, 3, config=titan.config, absent=2)


def _ours(tmp_path) -> Case:
    """Our own store (Orbax), steps 1 and 3 saved by `CheckpointStore` from a training loop."""
    import jax.numpy as jnp

    from hybridckpt.store.manager import CheckpointStore

    root = str(tmp_path / "ours")
    with CheckpointStore(root, async_save=False) as store:
        for step in (1, 3):
            store.save(step, {"w": jnp.arange(12.0).reshape(3, 4) * step, "b": jnp.full((4,), float(step))})
    return Case("orbax", root, {s: os.path.join(root, str(s)) for s in (1, 3)}, 3, absent=2)


SOURCES = {"torchtitan": _titan, "trainer": _trainer, "trainer_deepspeed": _trainer_deepspeed, "deepspeed": _deepspeed, "deepspeed_universal": _universal, "megatron": _megatron,
           "megatron_dist": _megatron_dist, "paddleformers": _flex, "maxtext": _maxtext, "ours": _ours}


@pytest.fixture(params=sorted(SOURCES))
def case(request, tmp_path) -> Case:
    return SOURCES[request.param](tmp_path)


# -- every source, through the API and the CLI --------------------------------------------------------


def test_step_picks_that_step_and_an_absent_one_is_one_line(case, capsys):
    root, early, late = case.root, case.early, max(case.folders)
    alone = {s: _values(open_checkpoint(f, config=case.config)) for s, f in case.folders.items()}
    assert not _same(alone[early], alone[late])  # the two steps differ: the checks below can fail
    picked = open_checkpoint(root, step=early, config=case.config)
    assert picked.format == case.fmt and _same(_values(picked), alone[early])
    assert any(f"read step {early} (asked for), {os.path.basename(case.folders[early])}/" in n for n in picked.notes)
    default = open_checkpoint(root, config=case.config)
    assert _same(_values(default), alone[case.default])
    with pytest.raises(FormatError) as e:
        open_checkpoint(root, step=case.absent, config=case.config)
    assert f"no step {case.absent}" in str(e.value) and f"steps {early}, {late}" in str(e.value)

    cfg = ["--config", case.config] if case.config else []
    code, out, _ = _run(capsys, "inspect", root, "--json", "--step", str(early), *cfg)
    info = json.loads(out)
    assert code == 0 and info["steps"] == [early, late] and info["default_step"] == case.default
    assert any(f"read step {early} (asked for)" in n for n in info["notes"])
    code, out, _ = _run(capsys, "inspect", root, *cfg)
    assert code == 0 and f"steps:     {early}, {late} (default {case.default}; the one shown)" in out
    code, out, _ = _run(capsys, "inspect", root, "--step", str(early), *cfg)
    assert code == 0 and f"steps:     {early}, {late} (default {case.default}; shown: {early})" in out
    code, out, err = _run(capsys, "inspect", root, "--step", str(case.absent), *cfg)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert f"no step {case.absent}" in err and f"steps {early}, {late}" in err


def test_a_damaged_later_step_does_not_matter(case, capsys):
    early = case.early
    want = _values(open_checkpoint(case.folders[early], config=case.config))
    assert _truncate_all(case.folders[max(case.folders)]) > 0
    assert _same(_values(open_checkpoint(case.root, step=early, config=case.config)), want)
    cfg = ["--config", case.config] if case.config else []
    code, out, _ = _run(capsys, "inspect", case.root, "--json", "--step", str(early), *cfg)
    assert code == 0 and any(f"read step {early} (asked for)" in n for n in json.loads(out)["notes"])


# -- the commands that take --step ------------------------------------------------------------------


def test_import_export_verify_and_logits_take_the_step(tmp_path, capsys):
    """The reported cases: `import DIR --step 1` of a torchtitan folder imported step 3;
    `export` / `logits --step` refused it."""
    from meshes import fit
    from safetensors.numpy import load_file

    case = _titan(tmp_path)
    early = case.folders[1]
    ck = str(tmp_path / "ck")
    code, out, _ = _run(capsys, "import", case.root, ck, "--step", "1", "--config", case.config, "--quiet")
    assert code == 0 and "at step 1 " in out, out
    code, out, _ = _run(capsys, "verify", early, ck, "--config", case.config)
    assert code == 0, out
    code, out, _ = _run(capsys, "verify", case.root, ck, "--step", "1", "--config", case.config)
    assert code == 0, out
    code, out, _ = _run(capsys, "verify", case.root, ck, "--config", case.config)
    assert code == 1 and "BAD" in out  # the default, step 3, is another step

    code, _, err = _run(capsys, "verify", ck, "--step", "3")  # ours holds step 1 alone
    assert code == 2 and "no step 3" in err and "steps 1 (default 1: the latest)" in err
    code, _, err = _run(capsys, "verify", os.path.join(ck, "1"), "--step", "3")
    assert code == 2 and "no step 3: this is the folder of step 1" in err

    out_dir, alone = str(tmp_path / "out"), str(tmp_path / "alone")
    assert _run(capsys, "export", case.root, out_dir, "--step", "1", "--quiet")[0] == 0
    assert _run(capsys, "export", early, alone, "--quiet")[0] == 0
    got, want = load_file(os.path.join(out_dir, "model.safetensors")), load_file(os.path.join(alone, "model.safetensors"))
    assert _same(got, want)

    a, b = str(tmp_path / "a.npy"), str(tmp_path / "b.npy")
    assert _run(capsys, "logits", case.root, "--step", "1", "--tokens", "1,2,3", "--out", a,
                "--config", case.config, "--mesh", fit("dp=1"))[0] == 0
    assert _run(capsys, "logits", early, "--tokens", "1,2,3", "--out", b, "--config", case.config)[0] == 0
    assert np.load(a).tobytes() == np.load(b).tobytes()
    code, _, err = _run(capsys, "export", case.root, str(tmp_path / "x"), "--step", "2", "--quiet")
    assert code == 2 and "no step 2" in err and "steps 1, 3" in err and not os.path.exists(tmp_path / "x")


def test_a_source_of_one_step_takes_only_its_own(tmp_path, capsys):
    case = _trainer(tmp_path)
    one = case.folders[2]
    assert open_checkpoint(one, step=2).step == 2
    code, _, err = _run(capsys, "inspect", one, "--step", "4")
    assert code == 2 and "no step 4" in err and "holds one step (step 2)" in err
    code, _, err = _run(capsys, "verify", one, case.folders[4], "--step", "2")
    assert code == 2 and "is a folder of several steps" in err and err.count("\n") == 1
    code, out, _ = _run(capsys, "verify", case.root, one, "--step", "2")  # step 2 of the output folder
    assert code == 0, out


# -- the listing itself -----------------------------------------------------------------------------


def test_step_folder_names_are_parsed_strictly(tmp_path):
    pattern = StepPattern("step-")
    for name in ("step-3", "step-007", "step-" + "9" * MAX_DIGITS):
        (tmp_path / name).mkdir()
    for name in ("step--1", "step-+4", "step- 5", "step-\u0665", "step-1e3", "step-" + "9" * (MAX_DIGITS + 1),
                 "step-", "Step-8", "step-8x"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-11").write_text("a file, not a folder")
    found = listing(str(tmp_path), pattern)
    assert found.steps == [3, 7, int("9" * MAX_DIGITS)]
    assert found.default == int("9" * MAX_DIGITS) and found.default_from == "the latest"
    assert found.folder(7) == str(tmp_path / "step-007")
    (tmp_path / "step-3" / "x").mkdir()
    with pytest.raises(FormatError, match=r"no step 11 \(step-11 holds no checkpoint files"):
        found.folder(11)


def test_two_folders_of_one_step_are_named_not_guessed(tmp_path):
    (tmp_path / "iter_5").mkdir()
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000006").mkdir()
    found = listing(str(tmp_path), StepPattern("iter_"))
    assert found.folder(6) == str(tmp_path / "iter_0000006")
    with pytest.raises(FormatError, match=r"step 5 is in several folders \['iter_0000005', 'iter_5'\]"):
        found.folder(5)


def test_a_long_run_is_listed_in_one_short_line(tmp_path):
    for s in range(0, 5000, 10):
        (tmp_path / f"checkpoint-{s}").mkdir()
    with pytest.raises(FormatError) as e:
        listing(str(tmp_path), StepPattern("checkpoint-")).folder(5)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and "0, 10, 20" in msg and "4990 (default 4990: the latest)" in msg


@pytest.mark.parametrize("kind", ["megatron", "megatron_dist"])
def test_a_tracker_naming_a_lost_iteration_leaves_the_others_readable(kind, tmp_path, capsys):
    case = SOURCES[kind](tmp_path)
    want = _values(open_checkpoint(case.folders[2]))
    shutil.rmtree(case.folders[6])  # the tracker still names iteration 6
    assert _same(_values(open_checkpoint(case.root, step=2)), want)
    with pytest.raises(FormatError, match="latest_checkpointed_iteration.txt names '6' but the folder"):
        open_checkpoint(case.root)
    code, out, _ = _run(capsys, "inspect", case.root, "--json", "--step", "2")
    assert code == 0 and json.loads(out)["steps"] == [2] and json.loads(out)["default_step"] == 6
