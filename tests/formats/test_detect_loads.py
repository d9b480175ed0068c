"""What format detection imports (issue 42): `registry.detect` tries the formats before DCP's
(maxtext, megatron, megatron-dist, flex-checkpoint, hf-trainer, lightning) on every DCP source
(the benchmark's), so each of them must import only its detect code, never its reader (the
pickle machine's users, Paddle's optimizer names, the HF reader...). One fresh interpreter
detects torchtitan's own DCP checkpoint and lists what it imported; another opens Megatron-Core's
own torch_dist checkpoint and lists the model families it imported. Counts, not timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from real.cases import case_dir

from hybridckpt.formats import flex_checkpoint, lightning, megatron, megatron_dist, trainer
from hybridckpt.formats.flex_checkpoint import reader as flex_reader
from hybridckpt.formats.lightning import reader as lightning_reader
from hybridckpt.formats.megatron import config as megatron_config
from hybridckpt.formats.megatron import reader as megatron_reader
from hybridckpt.formats.megatron_dist import reader as megatron_dist_reader
from hybridckpt.formats.trainer import reader as trainer_reader

PROBE = r"""
import json, sys
from hybridckpt.formats import registry
before = set(sys.modules)
name = registry.detect(sys.argv[1])
print(json.dumps({"format": name, "new": sorted(set(sys.modules) - before)}))
"""

# the formats tried before DCP -> the modules their `detect` may import (their package's `__init__` too)
DETECT_CODE = {
    "maxtext": {"layout", "scan_groups"},
    "megatron": {"layout"},
    "megatron_dist": {"layout"},
    "flex_checkpoint": {"folders"},
    "trainer": {"folder"},
    "lightning": {"files"},
}


def test_detecting_a_dcp_folder_imports_only_the_detect_code_of_the_formats_before_it():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    src = os.path.join(case_dir("torchtitan_llama3"), "ckpt", "step-3")
    r = subprocess.run([sys.executable, "-c", PROBE, src], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["format"] == "dcp", got
    new = set(got["new"])
    beyond = sorted(m for m in new for pkg, allowed in DETECT_CODE.items()
                    if m.startswith(f"hybridckpt.formats.{pkg}.") and m.split(".")[3] not in allowed)
    # (old code: megatron's reader, config, model, optimizer...; megatron_dist's; flex_checkpoint's
    # metadata, storage, reader; trainer's reader and fsdp; lightning's reader, prefix, state: 22)
    assert beyond == [], beyond
    others = sorted(m for m in new if m.startswith(("hybridckpt.formats.paddle", "hybridckpt.formats.hf",
                                                    "hybridckpt.formats.index_optim",
                                                    "hybridckpt.containers.pickle.paddle_save")))
    assert others == [], others  # what those readers pulled in (old code: 11 modules)
    assert "hybridckpt.formats.dcp.reader" in new  # the chosen one's reader is there


def test_the_detect_modules_of_pickle_formats_load_the_pickle_machinery_only_to_read_one():
    """Megatron's layout, Meta's Llama reader and Lightning's files import the restricted
    unpickler where they read a pickle, not when they are imported (detection imports them for
    every source). One fresh interpreter imports the three and lists the pickle modules loaded."""
    probe = ("import json, sys\n"
             "import hybridckpt.formats.megatron.layout, hybridckpt.formats.meta_llama, hybridckpt.formats.lightning.files\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hybridckpt.containers.pickle'))))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []  # (old code: torch_save and 9 more)


def test_the_packages_still_export_their_readers_names():
    """The names imported on first use are the reader's own objects."""
    assert megatron.open is megatron_reader.open and megatron.NAME == megatron_reader.NAME == "megatron"
    assert megatron.model_config is megatron_config.model_config
    assert megatron_dist.open is megatron_dist_reader.open and megatron_dist.NAME == "megatron-dist"
    assert flex_checkpoint.open is flex_reader.open and flex_checkpoint.NAME == "flex-checkpoint"
    assert flex_checkpoint.detect is flex_reader.detect and flex_checkpoint.steps is flex_reader.steps
    assert trainer.open is trainer_reader.open and trainer.NAME == "hf-trainer"
    assert trainer.detect is trainer_reader.detect and trainer.steps is trainer_reader.steps
    assert lightning.open is lightning_reader.open and lightning.NAME == "lightning"
    for pkg in (megatron, megatron_dist, flex_checkpoint, trainer, lightning):
        assert sorted(n for n in pkg.__all__ if not hasattr(pkg, n)) == [], pkg.__name__
        assert not hasattr(pkg, "no_such_name")


OPEN_PROBE = r"""
import json, sys
from hybridckpt import models
from hybridckpt.jobs.open import open_checkpoint
opened = open_checkpoint(sys.argv[1])
print(json.dumps({"family": models.family_of(opened.config).name, "speaking": sorted(models.speaking("megatron")),
                  "families": sorted({m.split(".")[2] for m in sys.modules
                                      if m.startswith("hybridckpt.models.") and m.count(".") >= 2})}))
"""


FAMILIES_PROBE = r"""
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(f"hybridckpt.models.{name}")
print(json.dumps(sorted({m.split(".")[2] for m in sys.modules if m.startswith("hybridckpt.models.") and m.count(".") >= 2})))
"""


def test_opening_a_megatron_source_imports_only_the_families_that_speak_megatron():
    """Which family Megatron args describe is asked of the families with a megatron dialect
    (11 of the 27), and the model config read by the one found: looking each up by name, then
    the config by its HF architecture, imported every family's package (about 30 ms of the open
    and 49 modules an import never used). Megatron-Core's own torch_dist checkpoint."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    src = os.path.join(case_dir("megatron_core_dense_dp_reshardable"), "ckpt")
    r = subprocess.run([sys.executable, "-c", OPEN_PROBE, src], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["family"] == "llama", got
    # what importing those families alone loads (mixtral's package imports mistral's)
    r = subprocess.run([sys.executable, "-c", FAMILIES_PROBE, *got["speaking"]], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    allowed = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert "llama" in got["families"] and "gemma2" in os.listdir(os.path.join(root, "models"))
    loaded = {f for f in got["families"] if os.path.isfile(os.path.join(root, "models", f, "__init__.py"))}
    assert loaded <= allowed, sorted(loaded - allowed)  # (old code: every family folder, 27)
