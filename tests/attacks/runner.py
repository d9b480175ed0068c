"""Run every (payload, container) case in a child process with a capped address space.

    python -m attacks.runner WORKDIR OUT.json [--limit-mb 256]      (with tests/ on sys.path)

The child first opens each container once with a benign fragment (so every import and lazy
allocation of the readers has happened), then caps its address space (RLIMIT_AS) at what it
uses plus `--limit-mb`, and opens each hostile case. An allocation the size a payload claims
(a terabyte) would fail there with MemoryError, which the checks below do not accept as a
refusal: the error must name the offending global or field. The result per case is written to
OUT.json: error type, message, whether the marker file appeared, and the peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


@dataclass
class Result:
    """What happened to one case; `ok` when it was refused as it should be."""

    id: str
    kind: str
    error: str  # exception type name, "" when nothing was raised
    message: str
    marker: bool  # the marker file exists: something ran
    ok: bool
    why: str = ""


def judge(case, error: BaseException | None, marker: str, file: str) -> Result:
    """Refused with a project error naming the file and matching `expect`, nothing ran."""
    from hybridckpt.errors import HybridCkptError

    msg = " ".join(str(error).split()) if error is not None else ""
    ran = os.path.exists(marker)
    why = ""
    if error is None:
        why = "loaded without an error"
    elif not isinstance(error, HybridCkptError):
        why = f"escaped as {type(error).__name__}"
    elif not re.search(case.payload.expect, msg):
        why = f"message does not match {case.payload.expect!r}"
    elif os.path.basename(file) not in msg:
        why = f"message does not name {os.path.basename(file)}"
    elif "MemoryError" in msg:
        why = "refused only because memory ran out"
    elif ran:
        why = "the marker file was created"
    return Result(case.id, case.payload.kind, type(error).__name__ if error else "", msg[:400],
                  ran, not why, why)


def run_case(case, workdir: str) -> Result:
    from attacks.containers import CONTAINERS, open_path

    folder = tempfile.mkdtemp(prefix="case-", dir=workdir)
    marker = os.path.join(folder, "PWNED")
    path, file = CONTAINERS[case.container].write(folder, case.payload.build, marker)
    err = None
    try:
        open_path(case.container, path)
    except BaseException as e:  # noqa: BLE001 - judged below
        if isinstance(e, KeyboardInterrupt):
            raise
        err = e
    return judge(case, err, marker, file)


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def child(workdir: str, out: str, limit_mb: int) -> None:
    import attacks
    from attacks import opcodes as op
    from attacks.containers import CONTAINERS, load_file

    for name, c in CONTAINERS.items():  # warm up: imports, caches
        folder = tempfile.mkdtemp(prefix="warm-", dir=workdir)
        _, file = c.write(folder, lambda ctx: op.NONE, os.path.join(folder, "PWNED"))
        load_file(name, file)
        try:
            from attacks.containers import open_path

            open_path(name, _)
        except Exception:  # noqa: BLE001 - minimal containers need not be complete checkpoints
            pass
    cap = _vm_bytes() + limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:  # the cap is real: one allocation larger than it fails
        bytearray((limit_mb + 64) * 2**20)
        cap_active = False
    except MemoryError:
        cap_active = True
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    results = [asdict(run_case(case, workdir)) for case in attacks.cases()]
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(out, "w") as f:
        json.dump({"results": results, "rss_growth_kib": rss1 - rss0, "limit_mb": limit_mb, "cap_active": cap_active,
                   "seconds": time.perf_counter() - t0}, f)


def run_all(workdir: str, limit_mb: int = 256, timeout: float = 300) -> dict:
    """Run the child and return its report (raises with its output if it failed)."""
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "attacks.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
           "OPENBLAS_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "JAX_PLATFORMS": "cpu"}
    res = subprocess.run(
        [sys.executable, "-m", "attacks.runner", workdir, out, "--limit-mb", str(limit_mb)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE,
    )
    if res.returncode != 0:
        raise RuntimeError(f"attack runner failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("out")
    p.add_argument("--limit-mb", type=int, default=256)
    a = p.parse_args()
    child(a.workdir, a.out, a.limit_mb)
