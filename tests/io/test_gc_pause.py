"""`io.gc_pause.loading_modules`: the collector off while a job's heavy modules load; in the
`hybridckpt` command's own process their objects frozen after, so no later pass walks them (issue
42: two full passes of 23-59 ms in an import's `start`, then a 60 ms pass over everything they
made). Each case runs in a fresh interpreter: a freeze would stay in the test process."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import gc, json, sys
from hybridckpt.io import gc_pause
if sys.argv[1] == "cli":
    gc_pause.freeze_after_loading()
frozen0, passes = gc.get_freeze_count(), []
gc.callbacks.append(lambda phase, info: passes.append(info["generation"]) if phase == "start" else None)
with gc_pause.loading_modules():
    inside = gc.isenabled()
    made = [[i] for i in range(300_000)]  # many new container objects, as a module import makes
    passes_inside = len(passes)
print(json.dumps({"inside": inside, "passes_inside": passes_inside, "after": gc.isenabled(),
                  "frozen": gc.get_freeze_count() - frozen0, "made": len(made)}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_modules_load_with_the_collector_off_and_the_cli_freezes_what_they_made():
    got = _probe("cli")
    assert got["inside"] is False and got["passes_inside"] == 0  # no pass while they load
    assert got["after"] is True  # back on after
    assert got["frozen"] >= 300_000  # what they made (and everything alive) moved out of the passes' way


def test_a_program_that_imports_the_library_keeps_its_collector():
    got = _probe("library")
    assert got["inside"] is False and got["passes_inside"] == 0
    assert got["after"] is True
    assert got["frozen"] == 0  # nothing frozen outside the command's own process


CLI_PROBE = r"""
import atexit, gc, json, sys
seen = {}


class Watch:  # notes whether the collector was on when Orbax and TensorStore were first imported
    def find_spec(self, name, path=None, target=None):
        if name in ("orbax.checkpoint", "tensorstore") and name not in seen:
            seen[name] = gc.isenabled()
        return None


sys.meta_path.insert(0, Watch())
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
atexit.register(lambda: print(json.dumps({"on_at_import": seen, "frozen": gc.get_freeze_count(),
                                          "full_passes": len(full)}), file=sys.stderr))
sys.argv = ["hybridckpt", *sys.argv[1:]]
import runpy
runpy.run_module("hybridckpt.cli", run_name="__main__")
"""


def test_the_command_imports_with_orbax_loaded_collector_off_and_frozen(tmp_path):
    """`hybridckpt import` (the command's own process, `cli.run`): Orbax and TensorStore load with
    the collector off, and everything alive after them is frozen (before this, the same import
    ran two full passes while they loaded, and nothing was frozen until the job's end)."""
    from hybridckpt.demo import sample_path

    out = subprocess.run([sys.executable, "-c", CLI_PROBE, "import", sample_path(), str(tmp_path / "ck"),
                          "--mesh", "fsdp=1"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stderr.strip().splitlines()[-1])
    assert got["on_at_import"] == {"orbax.checkpoint": False, "tensorstore": False}, got
    assert got["frozen"] >= 100_000, got  # JAX's, Orbax's and TensorStore's objects, out of every pass's way
    assert got["full_passes"] == 0, got
