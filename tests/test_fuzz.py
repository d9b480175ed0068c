"""Fuzzing: 250 hypothesis cases per parser (zip directory, pickle stream, legacy torch,
safetensors header, DCP metadata, torch's own DCP metadata through the fast reader, Paddle
pickle, Paddle and Colossal JSON, HF index JSON), and 75 per whole-checkpoint target, each case
opening and reading a real checkpoint one of whose files is mutated (our store's `_METADATA`,
`.zarray`, trainer state and a chunk; MaxText's `_METADATA` and `.zarray`s; a PaddleFormers
FlexCheckpoint's metadata and data file; a Paddle hybrid rank file), and 50 per target of a real
tool's torch.save file mutated below its CRCs (`attacks/fuzz_trees.py`: DeepSpeed ZeRO-2 model
and optim states, DeepSpeed universal files, a Lightning `.ckpt`) or of megatron-core's
torch_dist `.metadata`. Nothing but a project error escapes, and no case runs past 5 s (a SIGALRM
per case).

Those are the default profile's counts (CI and the README's command): half of each target's
`cases`. `HYPOTHESIS_PROFILE=deep` runs all of them (500 per parser, 150 per whole checkpoint,
100 per fuzz_trees target; about twice this file's CPU). Derandomized (the same cases every
run) and without a database; `benchmarks/fuzz.py` runs the same targets with 10,000 cases each. Targets and strategies:
`tests/attacks/fuzzers.py`.
"""

from __future__ import annotations

import os

import pytest
from attacks import fuzzers
from hypothesis import HealthCheck, Phase, given, settings

# the share of each target's `cases` a profile runs (`$HYPOTHESIS_PROFILE`; default: "default")
PROFILES = {"default": 0.5, "deep": 1.0}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")


def _cases(target: fuzzers.Target) -> int:
    if PROFILE not in PROFILES:
        raise ValueError(f"$HYPOTHESIS_PROFILE={PROFILE!r}: expected one of {sorted(PROFILES)}")
    return round(target.cases * PROFILES[PROFILE])


@pytest.mark.parametrize("name", list(fuzzers.TARGETS))
def test_parser_only_raises_project_errors(tmp_path, name):
    target = fuzzers.TARGETS[name]
    state = target.setup(str(tmp_path))
    target.run(state, _seed_input(state))  # the seed input itself parses
    outcome = fuzzers.Outcome()
    cases = _cases(target)

    @settings(max_examples=cases, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(target.strategy(state))
    def case(data):
        fuzzers.run_case(target, state, data, outcome)

    case()
    assert outcome.cases == cases
    assert not outcome.escapes, outcome.escapes[:5]
    assert outcome.hangs == 0
    assert outcome.errors > cases // 2  # the mutations do break the input


def _seed_input(state: dict):
    if "bases" in state:
        return state["bases"][0]
    if "doc" in state:
        import json

        return json.dumps(state["doc"]).encode()
    return state["base"]


def test_a_hang_is_caught(monkeypatch):
    """The per-case alarm turns a case that never ends into a recorded hang."""
    import time

    monkeypatch.setattr(fuzzers, "CASE_SECONDS", 0.2)
    target = fuzzers.Target("sleeper", lambda f: {}, None, lambda s, d: time.sleep(5))
    outcome = fuzzers.Outcome()
    t0 = time.monotonic()
    fuzzers.run_case(target, {}, b"", outcome)
    assert outcome.hangs == 1 and time.monotonic() - t0 < 2
