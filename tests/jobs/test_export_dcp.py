"""`export --to dcp --optimizer`, resumed by the real torch FSDP2 on 1, 2 and 4 gloo ranks.

The source is a real FSDP2 training run (tests/fixtures/dcp_writer.py: 4 ranks, 3 AdamW steps,
with the gradients and params of its 4th step gathered by torch). It is imported onto a mesh of
the devices present, exported to DCP (several writer files, row-block chunks), and resumed by
tests/fixtures/dcp_resume.py: `get_state_dict` + `dcp.load` + `set_state_dict` into a model
and an AdamW built with other values, on another number of ranks. Then: every parameter and
every moment bitwise the run's (the moments are checked one by one: torch would leave one the
checkpoint lacks at its template's value), the step the run's, the param group the run's, and
the loader's own AdamW step with the run's 4th gradients equal to the run's 4th step (relative
1e-5; the same step from step 1 is off by far more: the check can fail).

Cost: the four resumes (the export on 1, 2 and 4 ranks, the direct export on 2) are one launch
of dcp_resume.py (`resumed`): torch and transformers are imported once, and each resume forks
its own fresh ranks and gloo group; the run writes its FSDP2 folders only (`DCP_WRITER_NO_TP`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from fixtures import FIXTURES
from fixtures.ckpt_checks import run_writer
from fixtures.torch_common import load_reference, reference_names

from hybridckpt import jobs
from hybridckpt.cli import main
from hybridckpt.containers.dcp_metadata import read_metadata

RESUME = os.path.join(FIXTURES, "dcp_resume.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The real FSDP2 run and its references (dcp_writer.py)."""
    out = tmp_path_factory.mktemp("fsdp2")
    run_writer(
        os.path.join(FIXTURES, "dcp_writer.py"), out, env={**os.environ, "DCP_WRITER_NO_TP": "1"}
    )
    return out


def _mesh() -> str:
    n = jax.device_count()
    return f"fsdp={n // 2},tp=2" if n >= 4 else f"fsdp={n}"


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The run imported onto a mesh, then exported to DCP in 3 files, chunks of at most 16 KiB."""
    d = tmp_path_factory.mktemp("dcp_export")
    orbax, out = str(d / "orbax"), str(d / "dcp")
    jobs.import_checkpoint(str(run / "fsdp2"), orbax, mesh=_mesh())
    assert main(["export", orbax, out, "--to", "dcp", "--optimizer", "--writers", "3", "--max-shard-gb",
                 str(16 / 1024**2), "--quiet"]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def direct(run, tmp_path_factory):
    """DCP (4 ranks) -> DCP without an import between: (the export's folder, its summary)."""
    out = str(tmp_path_factory.mktemp("dcp_direct") / "dcp")
    return out, jobs.export_checkpoint(str(run / "fsdp2"), out, to="dcp", optimizer=True)


WORLDS = (1, 2, 4)


@pytest.fixture(scope="module")
def resumed(exported, direct, run, tmp_path_factory):
    """Every resume of this file from one launch of dcp_resume.py (`--jobs`): the export on each
    of WORLDS ranks, the direct export on 2. Maps ("export", world) / "direct" to a function
    giving what that resume loaded and stepped (or failing the test with its traceback)."""
    d = tmp_path_factory.mktemp("resumed")
    outs = {("export", w): str(d / f"export{w}.npz") for w in WORLDS} | {
        "direct": str(d / "direct.npz")
    }
    ckpts = {("export", w): exported for w in WORLDS} | {"direct": direct[0]}
    worlds = {("export", w): w for w in WORLDS} | {"direct": 2}
    args = [a for k in outs for a in (ckpts[k], outs[k], str(worlds[k]))]
    res = subprocess.run(
        [sys.executable, RESUME, "--jobs", str(run / "fsdp2_ref.npz"), str(run / "fsdp2_ref.json"), *args],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip

    def get(key):
        err = outs[key] + ".err"
        assert not os.path.exists(err), open(err).read()[-3000:] + res.stderr[-6000:]
        assert os.path.exists(outs[key]), (res.returncode, res.stderr[-6000:])
        return np.load(outs[key])

    return get


def resume(ckpt: str, world: int, run, out, config: str | None = None):
    """What `dcp_resume.py` (the real FSDP2 on `world` ranks) loaded and stepped."""
    res = subprocess.run(
        [sys.executable, RESUME, ckpt, str(out), str(world), str(run / "fsdp2_ref.npz"),
         str(run / "fsdp2_ref.json"), *([config] if config else [])],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-6000:]
    return np.load(out)


def assert_resumed(got, run) -> None:
    ref, info = load_reference(run, "fsdp2")
    names = reference_names(ref, "param")
    assert reference_names(got, "param") == names
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert reference_names(got, kind) == names, kind  # every moment arrived
        for n in names:
            assert np.array_equal(got[f"{kind}/{n}"], ref[f"{kind}/{n}"]), (kind, n)
    assert {float(got[f"step/{n}"]) for n in names} == {info["step"]} == {3.0}
    hyper = info["hyper"]
    for k in ("lr", "eps", "weight_decay"):
        assert float(got[f"group/{k}"]) == hyper[k], k
    assert tuple(got["group/betas"]) == tuple(hyper["betas"])
    worst = worst_control = 0.0
    for n in names:
        want = ref[f"next/{n}"]
        scale = np.abs(want).max()
        worst = max(worst, np.abs(got[f"next/{n}"] - want).max() / scale)
        worst_control = max(worst_control, np.abs(got[f"next_step1/{n}"] - want).max() / scale)
    assert worst <= 1e-5, worst
    assert worst_control > 1e-2, worst_control  # from step 1 instead: far off


def test_the_files_are_torchs_layout(exported):
    names = sorted(os.listdir(exported))
    assert names == [
        ".hybridckpt-export",
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]  # + our marker
    md = read_metadata(exported)
    embed = md.tensors["model.model.embed_tokens.weight"]
    assert embed.shape == (250, 64) and len(embed.chunks) == 4  # 16 KiB blocks of 64 rows
    assert md.tensors["optim.state.model.embed_tokens.weight.step"].shape == ()
    assert md.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_resumes_the_export(resumed, run, world):
    assert_resumed(resumed(("export", world)), run)


def test_fsdp2_resumes_a_direct_export(direct, resumed, run):
    """DCP (4 ranks) -> DCP without an import between: the same, resumed on 2 ranks."""
    _, s = direct
    assert s.with_optimizer and s.files == ("__0_0.distcp", ".metadata")
    assert_resumed(resumed("direct"), run)


def test_without_optimizer_state_the_weights_export_with_a_note(run, tmp_path):
    out = tmp_path / "w"
    jobs.export_checkpoint(str(run / "fsdp2"), str(out), to="dcp")  # weights only: fine
    md = read_metadata(str(out))
    assert not any(k.startswith("optim.") for k in md.tensors)
    # --optimizer on a weights-only source: the weights, and a note that there was nothing more
    # (issue 37: it was refused, which broke the README's quick start on such a source)
    s = jobs.export_checkpoint(str(run / "fsdp2_hf"), str(tmp_path / "x"), to="dcp", optimizer=True)
    assert not s.with_optimizer and any("holds no optimizer state" in n for n in s.notes), s.notes
    assert sorted(read_metadata(str(tmp_path / "x")).tensors) == sorted(md.tensors)


def test_unknown_hyperparameters_are_torchs_defaults_and_said(tmp_path):
    """A source that recorded no param group gets torch's AdamW defaults, and the summary says so."""
    from hybridckpt.formats.dcp.write import adamw_group

    group, notes = adamw_group({})
    assert (
        group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999) and group["decoupled_weight_decay"]
    )
    assert notes and "defaults" in notes[0]
    group, notes = adamw_group({"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1})
    assert (group["lr"], group["betas"], group["initial_lr"]) == (
        0.01,
        (0.9, 0.95),
        0.01,
    ) and not notes


def test_cli_refuses_layout_flags_of_other_targets(run, tmp_path, capsys):
    assert main(["export", str(run / "fsdp2"), str(tmp_path / "a"), "--tp", "2", "--quiet"]) == 2
    assert "--to megatron" in capsys.readouterr().err
    assert (
        main(["export", str(run / "fsdp2"), str(tmp_path / "b"), "--writers", "0", "--to", "dcp"])
        == 2
    )
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
