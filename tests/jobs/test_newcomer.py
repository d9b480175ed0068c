"""A new user's first hour (issue 12): each defect found trying the README, the CLI and the
library as a newcomer would, pinned by a test that failed before the fix. CLI behaviour is
checked through the CLI's `main` in this process (exit code, stdout and stderr as a user sees
them), and in a subprocess where a signal is the point (Ctrl-C)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
from meshes import fit

from hybridckpt import lazy, models, naming
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.formats.hf.write import write_hf
from hybridckpt.io.byte_source import close_all

CLI = [sys.executable, "-m", "hybridckpt.cli"]


@dataclass(frozen=True)
class Ran:
    """What a user sees of one command: its exit code, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys):
    """`run(*args, cwd=None)`: the CLI's `main` in this process (a fresh interpreter per command
    cost ~2 CPU-s each and tested nothing more here), run from `cwd` when given."""

    def call(*args: str, cwd=None) -> Ran:
        capsys.readouterr()
        here = os.getcwd()
        if cwd is not None:
            os.chdir(cwd)
        try:
            code = main([str(a) for a in args])
        finally:
            os.chdir(here)
            close_all()
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return call


def write_llama(path, *, layers: int = 2, hidden: int = 64, vocab: int = 256, seed: int = 0) -> None:
    cfg = models.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_layers=layers, num_heads=4, num_kv_heads=2)
    rng = np.random.default_rng(seed)
    flat = {k: lazy.ArrayTensor(rng.standard_normal(s).astype(np.float32))
            for k, s in naming.flatten(models.param_shape_tree(cfg)).items()}
    write_hf(str(path), naming.tree_to_hf(flat, cfg), models.config_to_hf(cfg))


# -- 1, 3: relative paths everywhere; outputs readable by teammates --------------------------------


def test_relative_paths_work_in_every_command_and_outputs_get_the_umask_modes(tmp_path, run):
    shutil.copytree(sample_path(), tmp_path / "src")
    old = os.umask(0o022)
    try:
        for args in (["import", "src", "ck", "--mesh", fit("fsdp=2,tp=2,pp=2"), "--quiet"],
                     ["export", "ck", "out", "--optimizer", "--quiet"],
                     ["verify", "src", "out", "--quiet"],
                     ["verify", "ck"],
                     ["logits", "ck", "--tokens", "1,2,3"],
                     ["inspect", "ck"]):
            r = run(*args, cwd=tmp_path)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
            assert "Traceback" not in r.stderr
    finally:
        os.umask(old)
    for folder in ("ck", "out"):
        assert (os.stat(tmp_path / folder).st_mode & 0o777) == 0o755, folder
    assert (os.stat(tmp_path / "out" / "model.safetensors").st_mode & 0o777) == 0o644


# -- 4: an indivisible vocabulary is replicated by default ------------------------------------------


def test_gpt2_with_vocab_50257_imports_onto_an_ordinary_mesh(tmp_path, run):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    mesh = fit("fsdp=2,tp=2,pp=2", keep="tp")  # tp=2 down to 2 devices; dp=1 on one
    r = run("import", str(tmp_path / "gpt2"), str(tmp_path / "ck"), "--mesh", mesh, "--quiet")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if "replicated where the mesh cannot divide" in line]
    if mesh == "dp=1":  # one device: every axis of size 1 divides the vocab; nothing replicated
        assert notes == [], r.stdout
    else:
        assert len(notes) == 1 and "wte.embedding dim 0 (vocab 50257 over tp=2)" in notes[0], r.stdout
    assert run("export", str(tmp_path / "ck"), str(tmp_path / "out"), "--quiet").returncode == 0
    v = run("verify", str(tmp_path / "gpt2"), str(tmp_path / "out"), "--quiet")
    assert v.returncode == 0, v.stdout
    strict = run("import", str(tmp_path / "gpt2"), str(tmp_path / "ck2"), "--mesh", mesh,
                 "--strict-sharding", "--quiet")
    if mesh == "dp=1":
        assert strict.returncode == 0, strict.stderr
        return
    assert strict.returncode == 2 and "wte.embedding: dim 0 (vocab) has size 50257" in strict.stderr
    assert strict.stderr.count("\n") == 1 and not (tmp_path / "ck2").exists()


# -- 5: Ctrl-C ----------------------------------------------------------------------------------------


def _interrupt(args, when, tmp_path, name) -> tuple[int, str, str]:
    """Run the CLI; `when` seconds after its temporary output `.<name>.tmp-*` appears (the save
    has begun), send SIGINT."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 60
    while p.poll() is None and time.time() < deadline:
        if any(f.startswith(f".{name}.tmp-") for f in os.listdir(tmp_path)):
            break
        time.sleep(0.01)
    time.sleep(when)
    try:
        p.send_signal(signal.SIGINT)
    except ProcessLookupError:
        pass
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def test_ctrl_c_prints_one_line_exits_130_and_leaves_nothing_or_the_previous(tmp_path, run):
    src = tmp_path / "src"
    write_llama(src, layers=8, hidden=512, vocab=4096)  # ~100 MB: several seconds to import
    prev = tmp_path / "prev"
    assert run("import", str(src), str(prev), "--params-only", "--quiet").returncode == 0
    outcomes = set()
    for i, when in enumerate((0.0, 0.3, 0.8)):
        dst = tmp_path / f"dst{i}"
        code, out, err = _interrupt(["import", str(src), str(dst), "--mesh", fit("fsdp=2,tp=2"), "--quiet",
                                     "--io-threads", "2"], when, tmp_path, f"dst{i}")
        assert "Traceback" not in err and "Exception ignored" not in err, err
        if code == 130:
            assert err.count("\n") == 1 and err.startswith("hybridckpt: interrupted"), err
            assert not dst.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(f".dst{i}")]
        else:
            assert code == 0 and "imported" in out and run("verify", str(dst)).returncode == 0
        outcomes.add(code)
    assert 130 in outcomes  # at least one landed mid-import: the test can fail
    # an interrupted --overwrite leaves the previous checkpoint whole
    code, _, err = _interrupt(["import", str(src), str(prev), "--overwrite", "--quiet"], 0.2, tmp_path, "prev")
    assert code in (0, 130) and run("verify", str(prev)).returncode == 0, err


def test_a_late_ctrl_c_does_not_turn_a_finished_job_into_a_failure(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.Popen([*CLI, "import", sample_path(), str(tmp_path / "ck"), "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = p.stdout.readline()  # the job is done once it says so
    assert first.startswith("imported"), first
    try:
        p.send_signal(signal.SIGINT)
    except ProcessLookupError:
        pass
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (out, err)
    assert "Traceback" not in err and "Exception ignored" not in err and "interrupted" not in err


# -- 7: messages ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh, message", [
    ("tp=0", "sizes must be positive, found tp=0"),
    ("dp=-2", "sizes must be positive, found dp=-2"),
    ("tp=2,tp=2", "axis tp is given twice"),
    ("tp=two", "tp='two' is not an integer size"),
    ("xx=2", "unknown axis 'xx'; the axes are dp, fsdp, tp, pp"),
    ("tp2", "'tp2' is not axis=size"),
])
def test_mesh_mistakes_are_named(mesh, message, tmp_path, run):
    r = run("import", sample_path(), str(tmp_path / "x"), "--mesh", mesh)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_messages_speak_the_cli_words(tmp_path, run):
    ck = tmp_path / "ck"
    assert run("import", sample_path(), str(ck), "--quiet").returncode == 0
    again = run("import", sample_path(), str(ck), "--quiet")
    assert again.returncode == 2 and "--overwrite" in again.stderr
    empty = run("logits", str(ck), "--tokens", "")
    assert empty.returncode == 2 and "expected at least one token id" in empty.stderr
    step = run("export", sample_path(), str(tmp_path / "o"), "--step", "5")
    assert step.returncode == 2 and "no step 5: this hf checkpoint holds one step" in step.stderr
    gpt2_cfg = tmp_path / "gpt2.json"
    gpt2_cfg.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2,
                                    "n_head": 4, "vocab_size": 64, "n_positions": 32}))
    wrong = run("import", sample_path(), str(tmp_path / "w"), "--config", str(gpt2_cfg))
    assert wrong.returncode == 2 and "the config describes a gpt2 model (GPT2LMHeadModel)" in wrong.stderr
    assert "not that model's" in wrong.stderr and "no rule consumes" not in wrong.stderr


# -- 9: output consistency ---------------------------------------------------------------------------


def test_output_says_what_it_counts_and_every_argument_has_help(tmp_path, run):
    inspect = run("inspect", sample_path())
    assert "tensors:   21 (" in inspect.stdout and "config:    {\"family\": \"llama\"" in inspect.stdout
    imp = run("import", sample_path(), str(tmp_path / "ck"), "--quiet")
    assert "12 param arrays from 21 source tensors (layers stacked), 24 optimizer arrays" in imp.stdout
    assert "0.00 GB/s" not in imp.stdout and "MB/s" in imp.stdout
    ins = run("inspect", str(tmp_path / "ck"))
    assert "step:      12" in ins.stdout and "None" not in ins.stdout
    for command in ("inspect", "import", "export", "verify", "logits"):
        text = run(command, "--help").stdout
        assert "progress bar" not in text or command != "inspect"
        block = text.split("positional arguments:")[1].split("options:")[0]
        entries = [line for line in block.splitlines() if line.startswith("  ") and not line.startswith("   ")]
        assert entries, command
        for line in entries:  # `  NAME  help...`: every positional has its help on its line
            assert len(line.split()) > 1, (command, line)
    logits_help = run("logits", "--help").stdout
    assert "mesh to run on" in logits_help and "dtype of activations" in logits_help


def test_the_progress_bar_is_told_its_total_before_the_first_tensor(tmp_path):
    """The bar showed `14.2/? MB`: the jobs now give the total (bytes) before streaming."""
    from hybridckpt import jobs

    class Recorder:
        def __init__(self):
            self.total, self.seen = None, 0

        def set_total(self, nbytes):
            assert self.seen == 0  # told before any tensor is done
            self.total = nbytes

        def __call__(self, name, nbytes):
            self.seen += nbytes

    for job, args in ((jobs.import_checkpoint, (sample_path(), str(tmp_path / "ck"))),
                      (jobs.export_checkpoint, (sample_path(), str(tmp_path / "out")))):
        rec = Recorder()
        s = job(*args, progress=rec)
        assert rec.total == rec.seen >= s.bytes > 0, (job.__name__, rec.total, rec.seen, s.bytes)
