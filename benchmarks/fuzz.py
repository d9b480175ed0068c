"""Fuzz every parser: 10,000 hypothesis cases each by default, and atheris (coverage-guided
libFuzzer) when it is installed.

    python benchmarks/fuzz.py [--cases 10000] [--seed N] [--only "safetensors header" ...]
    python benchmarks/fuzz.py --engine atheris [--cases 10000]     (pip install atheris)

The targets and strategies are those of tests/test_fuzz.py (tests/attacks/fuzzers.py): zip
directory, pickle stream, legacy torch, safetensors header, DCP metadata, Paddle pickle,
Paddle model_meta JSON, Colossal metadata JSON, HF index JSON, the whole-checkpoint targets and
real tools' torch.save files mutated below their CRCs (DeepSpeed, Lightning). A case passes when the parser
returns or raises a HybridCkptError; any other exception is an escape, a case over 5 s a hang.
hypothesis runs derandomized by default (the same cases every run; `--seed` draws others) with
byte and structural mutations; atheris mutates bytes from the target's seed input, guided by
the coverage of the hybridckpt readers (one child process per target). Prints one table and the
first escapes; exits 1 on any escape or hang.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _hypothesis(name: str, cases: int, seed_value: int | None, work: str):
    from attacks import fuzzers
    from hypothesis import HealthCheck, Phase, given, seed, settings

    target = fuzzers.TARGETS[name]
    state = target.setup(tempfile.mkdtemp(dir=work))
    outcome = fuzzers.Outcome()

    def one(data):
        fuzzers.run_case(target, state, data, outcome)

    def case(data):
        one(data)

    test = given(target.strategy(state))(case)
    test = settings(max_examples=cases, derandomize=seed_value is None, deadline=None, database=None,
                    phases=[Phase.generate], suppress_health_check=list(HealthCheck))(test)
    if seed_value is not None:
        test = seed(seed_value)(test)
    test()
    return outcome


def _seed_bytes(state: dict) -> bytes:
    if "bases" in state:
        return state["bases"][0]
    if "doc" in state:
        return json.dumps(state["doc"]).encode()
    return state["base"]


def _atheris_child(name: str, cases: int, report: str) -> None:
    """In a child process: libFuzzer runs `cases` inputs from the seed input, then exits."""
    import atheris

    with atheris.instrument_imports(include=["hybridckpt"]):
        import hybridckpt.containers.dcp_metadata  # noqa: F401
        import hybridckpt.containers.pickle.paddle_save  # noqa: F401
        import hybridckpt.containers.pickle.torch_save  # noqa: F401
        import hybridckpt.containers.safetensors_file  # noqa: F401
        import hybridckpt.formats.colossal  # noqa: F401
        import hybridckpt.formats.deepspeed  # noqa: F401
        import hybridckpt.formats.hf  # noqa: F401
        import hybridckpt.formats.lightning  # noqa: F401
        import hybridckpt.formats.megatron_dist  # noqa: F401
        import hybridckpt.formats.paddle  # noqa: F401
        import hybridckpt.jobs.open  # noqa: F401 - the whole-checkpoint targets' formats
    from attacks import fuzzers

    work = tempfile.mkdtemp(prefix="atheris-")
    target = fuzzers.TARGETS[name]
    state = target.setup(work)
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    with open(os.path.join(corpus, "seed"), "wb") as f:
        f.write(_seed_bytes(state))
    outcome = fuzzers.Outcome()

    def save():
        with open(report, "w") as f:
            json.dump({"cases": outcome.cases, "errors": outcome.errors, "hangs": outcome.hangs,
                       "escapes": outcome.escapes[:20], "n_escapes": len(outcome.escapes)}, f)

    def test_one(data: bytes) -> None:  # libFuzzer exits without atexit: report every case
        fuzzers.run_case(target, state, data, outcome)
        save()

    atheris.Setup([sys.argv[0], f"-runs={cases}", f"-max_len={max(4096, 2 * len(_seed_bytes(state)))}",
                   "-print_final_stats=0", corpus], test_one)
    atheris.Fuzz()


def _atheris(name: str, cases: int, work: str):
    from attacks import fuzzers

    report = os.path.join(work, f"{abs(hash(name))}.json")
    res = subprocess.run([sys.executable, __file__, "--atheris-child", name, "--cases", str(cases),
                          "--report", report], capture_output=True, text=True)
    if not os.path.exists(report):
        raise RuntimeError(f"atheris run for {name} failed:\n{res.stderr[-3000:]}")
    with open(report) as f:
        r = json.load(f)
    o = fuzzers.Outcome(escapes=r["escapes"] + [""] * (r["n_escapes"] - len(r["escapes"])),
                        hangs=r["hangs"], cases=r["cases"], errors=r["errors"])
    return o


def main() -> int:
    from attacks import fuzzers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--engine", choices=["hypothesis", "atheris"], default="hypothesis")
    p.add_argument("--seed", type=int, help="hypothesis: draw other cases (default: derandomized)")
    p.add_argument("--only", nargs="*", choices=list(fuzzers.TARGETS), help="these parsers only")
    p.add_argument("--atheris-child", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.atheris_child:
        _atheris_child(a.atheris_child, a.cases, a.report)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="hybridckpt-fuzz-") as work:
        for name in fuzzers.TARGETS:
            if a.only and name not in a.only:
                continue
            t0 = time.perf_counter()
            if a.engine == "atheris":
                outcome = _atheris(name, a.cases, work)
            else:
                outcome = _hypothesis(name, a.cases, a.seed, work)
            rows.append((name, outcome, time.perf_counter() - t0))
            for e in list(dict.fromkeys(outcome.escapes))[:5]:
                print(f"ESCAPE {name}: {e}", file=sys.stderr)
    print(f"engine: {a.engine}")
    print("| parser | cases | project errors | escapes | hangs (> 5 s) | seconds |")
    print("|---|---|---|---|---|---|")
    for name, o, sec in rows:
        print(f"| {name} | {o.cases} | {o.errors} | {len(o.escapes)} | {o.hangs} | {sec:.0f} |")
    return 1 if any(o.escapes or o.hangs for _, o, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
