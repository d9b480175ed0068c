"""Hostile pickles in every kind of file hybridckpt unpickles are refused, name the offending
global or field and the file, run nothing, and allocate nothing near what they claim.

The payloads (`tests/attacks/__init__.py`) are generated from opcodes in this session and
planted in torch zip / legacy files, DCP `.metadata`, Megatron `model_optim_rng.pt` args,
DeepSpeed `*_optim_states.pt`, Meta `consolidated.00.pth`, Colossal `.bin`, Paddle
`.pdparams` / `.pdopt` (`tests/attacks/containers.py`). All cases run once per session in a
child process whose address space is capped (`tests/attacks/runner.py`).
"""

from __future__ import annotations

import os

import attacks
import numpy as np
import pytest
from attacks import opcodes as op
from attacks.containers import CONTAINERS, STORAGE_BYTES, load_file
from attacks.runner import run_all

from hybridckpt.cli import main
from hybridckpt.io.byte_source import close_all
from hybridckpt.lazy import LazyTensor

CASES = list(attacks.cases())


@pytest.fixture(scope="session")
def report(tmp_path_factory):
    out = run_all(str(tmp_path_factory.mktemp("attacks")), limit_mb=256)
    return out | {"by_id": {r["id"]: r for r in out["results"]}}


def test_registry_covers_every_kind_and_container():
    assert len(attacks.PAYLOADS) >= 20
    kinds = {p.kind for p in attacks.PAYLOADS}
    assert kinds == {"exec", "gadget", "dos", "trick", "storage"}
    assert {c.container for c in CASES} == set(CONTAINERS)
    # every non-storage payload goes into every container; storage ones into every torch file
    torch_files = [n for n, c in CONTAINERS.items() if c.torch]
    for p in attacks.PAYLOADS:
        where = {c.container for c in CASES if c.payload is p}
        assert where == (set(torch_files) if p.torch_only else set(CONTAINERS)) - set(p.not_for)


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_containers_are_valid_around_the_payload(tmp_path, name):
    """With a harmless fragment the same file loads, and its tensor reads its exact bytes."""
    marker = str(tmp_path / "PWNED")
    _, file = CONTAINERS[name].write(str(tmp_path), lambda ctx: op.value(["harmless", 1]), marker)
    obj = load_file(name, file)
    if name == "dcp-metadata":
        assert vars(obj)["planner_data"]["evil"] == ["harmless", 1]
        return
    inner = obj
    if name == "megatron-args":
        inner = vars(obj["args"])
    elif name == "deepspeed-optim":
        inner = obj["optimizer_state_dict"]
    elif name == "paddle-pdopt":
        assert np.array_equal(obj["rms_norm_0.w_0_moment1_0"], np.zeros(8, np.float32))
    assert inner["evil"] == ["harmless", 1]
    if CONTAINERS[name].torch and "w" in obj:
        w = obj["w"]
        assert isinstance(w, LazyTensor)
        assert w.materialize().tobytes() == STORAGE_BYTES
    close_all()


def test_the_memory_cap_was_active(report):
    assert report["cap_active"]
    assert report["rss_growth_kib"] < report["limit_mb"] * 1024


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_payload_is_refused(report, case):
    r = report["by_id"][case.id]
    assert r["ok"], f"{case.id}: {r['why']} ({r['error']}: {r['message']})"
    assert r["error"] in ("UnsafePickleError", "FormatError") and not r["marker"]


def test_exec_payloads_are_unsafe_pickle_errors(report):
    for case in CASES:
        if case.payload.kind == "exec":
            assert report["by_id"][case.id]["error"] == "UnsafePickleError", case.id


@pytest.mark.parametrize("name", [n for n in CONTAINERS if n not in ("torch-zip", "torch-legacy")])
def test_cli_prints_one_line_and_exits_2(tmp_path, capsys, name):
    payload = next(p for p in attacks.PAYLOADS if p.name == "subprocess.Popen")
    marker = str(tmp_path / "PWNED")
    path, file = CONTAINERS[name].write(str(tmp_path), payload.build, marker)
    capsys.readouterr()
    code = main(["inspect", path])
    err = capsys.readouterr().err
    close_all()
    assert code == 2, err
    assert err.startswith("hybridckpt: error:") and err.count("\n") == 1, err
    assert "'subprocess.Popen'" in err and os.path.basename(file) in err
    assert not os.path.exists(marker)


def test_cli_debug_shows_the_traceback(tmp_path, capsys):
    payload = next(p for p in attacks.PAYLOADS if p.name == "os.system")
    path, _ = CONTAINERS["megatron-args"].write(str(tmp_path), payload.build, str(tmp_path / "PWNED"))
    code = main(["--debug", "inspect", path])
    err = capsys.readouterr().err
    close_all()
    assert code == 2 and "Traceback" in err and "UnsafePickleError" in err
    assert not (tmp_path / "PWNED").exists()
