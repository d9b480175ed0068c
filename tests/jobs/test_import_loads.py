"""What `hybridckpt import` loads before and while its job runs (issue 42: the modules a first job
loads are outside its seconds, but not outside the user's wall time).

One fresh interpreter runs the command (`cli.main`) on torchtitan's own DCP checkpoint (a real
Llama run, `tests/real/cases/torchtitan_llama3`) and reports which model families it imported: a
torchtitan source asks for the families that speak torchtitan (`models.dialects`), so the
registry of every family (`models.family._discover`, which imports all their packages: 58
modules) is never built. Counts, not timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from real.cases import case_dir

PROBE = r"""
import json, os, sys
from hybridckpt.cli import main
src, dst = sys.argv[1], sys.argv[2]
rc = main(["import", os.path.join(src, "ckpt"), dst, "--config", os.path.join(src, "config.json"),
           "--mesh", "fsdp=2", "--quiet"])
from hybridckpt.models import family
folders = family._folders()
loaded = sorted(p.rpartition(".")[2] for p in folders if p in sys.modules)
print(json.dumps({"rc": rc, "families": loaded, "folders": len(folders),
                  "registry_built": family._discover.cache_info().currsize > 0,
                  "modules": len(sys.modules)}))
"""


def test_a_torchtitan_import_loads_the_families_that_speak_torchtitan_only(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    dst = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-c", PROBE, case_dir("torchtitan_llama3"), str(dst)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and (dst / "3" / "opt_state").is_dir(), (got, r.stdout[-1000:])
    assert not got["registry_built"], got  # (old code: `family_named` built it, importing all 27 families)
    assert "llama" in got["families"], got
    # the torchtitan speakers (llama, qwen3, qwen3_moe, deepseek_v3), what they import, and
    # `models`' own GPT-2 and Llama configs: a minority of the families
    assert len(got["families"]) * 2 < got["folders"], got
