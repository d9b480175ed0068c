"""The reliability table: hostile pickles refused, damaged checkpoints diagnosed, kill points
survived, fuzz cases per parser without an escape. Every row should read N/N.

    python benchmarks/reliability.py [--fuzz-cases 500] [--kills 6] [--skip-fuzz]

It runs the same case lists the tests use (tests/attacks/): the payload x container corpus in
a child process with a capped address space (`attacks.runner`), every damage case through the
reader and the CLI (`attacks.damage`), seeded SIGKILLs of `hybridckpt import`, `export` and a
training-save loop (`attacks.crash`), and the hypothesis fuzz targets (`attacks.fuzzers`; the
tests run 500 cases per parser, `benchmarks/fuzz.py` 10,000). The default run takes about two
minutes on 2 cores. Prints one markdown table.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def _row(rows: list, what: str, good: int, tried: int, note: str = "") -> None:
    rows.append((what, f"{good}/{tried}", note))


def attacks(rows: list, work: str) -> None:
    from attacks import PAYLOADS
    from attacks.containers import CONTAINERS
    from attacks.runner import run_all

    rep = run_all(os.path.join(work, "attacks"), limit_mb=256)
    res = rep["results"]
    _row(rows, f"hostile pickles refused ({len(PAYLOADS)} payloads x {len(CONTAINERS)} file kinds)",
         sum(r["ok"] for r in res), len(res),
         f"nothing ran; address space capped at +{rep['limit_mb']} MB, peak RSS +{rep['rss_growth_kib'] // 1024} MB")
    by_container = collections.defaultdict(list)
    for r in res:
        by_container[r["id"].split(":", 1)[0]].append(r["ok"])
    for name, oks in by_container.items():
        _row(rows, f"  in {CONTAINERS[name].describe}", sum(oks), len(oks))
    bad = [r for r in res if not r["ok"]]
    for r in bad[:10]:
        print(f"NOT REFUSED {r['id']}: {r['why']} ({r['message'][:200]})", file=sys.stderr)


def damaged(rows: list, work: str) -> None:
    from attacks import damage
    from attacks.sources import build_sources

    sources = build_sources(os.path.join(work, "sources"))
    by_format = collections.defaultdict(list)
    for case in damage.CASES:
        r = damage.diagnose(case, sources, os.path.join(work, "damage"))
        why = r.why or damage.cli_check(case, r.path, os.path.join(os.path.dirname(r.path), "out"))
        if why:
            print(f"NOT DIAGNOSED {case.id}: {why} ({r.message[:200]})", file=sys.stderr)
        by_format[case.format].append(not why)
    total = [ok for oks in by_format.values() for ok in oks]
    _row(rows, "damaged checkpoints diagnosed (reader names file and key; CLI one line, exit 2)",
         sum(total), len(total))
    for fmt, oks in by_format.items():
        _row(rows, f"  {fmt}", sum(oks), len(oks))


def kills(rows: list, work: str, n: int) -> None:
    from attacks import crash

    base = os.path.join(work, "crash")
    os.makedirs(base)
    src = crash.write_hf_source(os.path.join(base, "hf"), seed=0)
    other = crash.write_hf_source(os.path.join(base, "other-hf"), seed=1)
    other_ckpt = os.path.join(base, "other-ckpt")
    res = subprocess.run(crash.cli("import", other, other_ckpt, "--quiet"), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr)
    for what, points in (
        ("import", crash.kill_imports(src, other_ckpt, base, seed=7, n=n)),
        ("export", crash.kill_exports(src, other, base, seed=8, n=n)),
        ("CheckpointStore training save", crash.kill_training(base, seed=9, n=n)),
    ):
        for p in points:
            if not p.ok:
                print(f"NOT SURVIVED {p}", file=sys.stderr)
        outcomes = collections.Counter(p.outcome if p.ok else "bad" for p in points)
        _row(rows, f"SIGKILL during {what}: kill points survived", sum(p.ok for p in points), len(points),
             ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))


def fuzz(rows: list, work: str, cases: int) -> None:
    from attacks import fuzzers
    from hypothesis import HealthCheck, Phase, given, settings

    for name, target in fuzzers.TARGETS.items():
        folder = tempfile.mkdtemp(prefix="fuzz-", dir=work)
        state = target.setup(folder)
        outcome = fuzzers.Outcome()
        t0 = time.perf_counter()

        def one(data, target=target, state=state, outcome=outcome):
            fuzzers.run_case(target, state, data, outcome)

        def case(data):
            one(data)

        test = settings(max_examples=cases, derandomize=True, deadline=None, database=None,
                        phases=[Phase.generate], suppress_health_check=list(HealthCheck))(
            given(target.strategy(state))(case))
        test()
        for e in outcome.escapes[:5]:
            print(f"ESCAPE {name}: {e}", file=sys.stderr)
        clean = outcome.cases - len(outcome.escapes) - outcome.hangs
        _row(rows, f"fuzz {name}: cases without an escape or hang", clean, outcome.cases,
             f"{len(outcome.escapes)} escapes, {outcome.hangs} hangs, {outcome.errors} project errors, "
             f"{time.perf_counter() - t0:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fuzz-cases", type=int, default=500, help="hypothesis cases per parser (default 500)")
    p.add_argument("--kills", type=int, default=6, help="kill points per command (default 6)")
    p.add_argument("--skip-fuzz", action="store_true")
    a = p.parse_args()
    t0 = time.perf_counter()
    rows: list = []
    with tempfile.TemporaryDirectory(prefix="hybridckpt-reliability-") as work:
        attacks(rows, work)
        damaged(rows, work)
        kills(rows, work, a.kills)
        if not a.skip_fuzz:
            fuzz(rows, work, a.fuzz_cases)
    print("| check | result | notes |")
    print("|---|---|---|")
    for what, result, note in rows:
        print(f"| {what} | {result} | {note} |")
    print(f"\n{time.perf_counter() - t0:.0f} s on {os.cpu_count()} cores")
    return 0 if all(r[1].split("/")[0] == r[1].split("/")[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
