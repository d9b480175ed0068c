"""What `pip install .` installs (issue 28): one package, `hybridckpt`, with the model families
inside it as `hybridckpt.models` (the repository's `models/` through the symlink
`hybridckpt/models -> ../models`) and no top-level `models` that a user's own `models/` folder
would fight with.

Checked as a user meets it: a wheel built from a copy of the checkout, installed NON-editable into
a fresh venv (its dependencies, jax and the rest, seen through a `.pth` line to this environment's
site-packages, whose own `.pth` files, the editable install of the checkout among them, are not
processed), then used from a folder that holds its own `models/` package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import hybridckpt
from hybridckpt.demo import sample_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sh(*cmd: str, cwd=None, env=None) -> str:
    r = subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-3000:])
    return r.stdout


def test_a_non_editable_install_leaves_a_users_models_folder_alone(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".*")
    for folder in ("hybridckpt", "models"):  # (the symlink hybridckpt/models copied as a link)
        shutil.copytree(os.path.join(ROOT, folder), src / folder, symlinks=True, ignore=ignore)
    assert os.path.islink(src / "hybridckpt" / "models")
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "w"), str(src))
    (wheel,) = (tmp_path / "w").iterdir()
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"hybridckpt"}, tops
    for needed in ("hybridckpt/models/llama/params.py", "hybridckpt/models/llama/dialects/megatron.rules", "hybridckpt/models/family.py",
                   "hybridckpt/samples/tiny-llama/config.json", "hybridckpt/__main__.py"):
        assert needed in names, needed

    venv = tmp_path / "venv"
    _sh(sys.executable, "-m", "venv", "--without-pip", str(venv))
    py = str(venv / "bin" / "python")
    site = _sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "deps-from-the-test-env.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    _sh(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", str(wheel))
    assert not os.path.exists(os.path.join(site, "models"))
    assert os.path.isdir(os.path.join(site, "hybridckpt", "models", "llama"))  # a real folder, not a link

    user = tmp_path / "project"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("MINE = 'the user models package'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")} | {"JAX_PLATFORMS": "cpu"}
    out = _sh(py, "-c", (
        "import models, hybridckpt\n"
        "from hybridckpt import models as families\n"
        "from hybridckpt.models import llama\n"
        "print(models.MINE)\n"
        "print(hybridckpt.__file__)\n"
        "print(families.__file__, families.LlamaConfig.__name__)\n"
        "try:\n"
        "    families.config_from_hf({'architectures': ['NotAModel']})\n"
        "except hybridckpt.HybridCkptError as e:\n"
        "    print(type(e).__module__, type(e).__name__)\n"
    ), cwd=user, env=env).splitlines()
    assert out[3] == "hybridckpt.errors UnknownModelError"  # the families' errors are the project's
    assert out[0] == "the user models package"
    assert out[1].startswith(site) and out[2].startswith(os.path.join(site, "hybridckpt", "models")), out
    # the command, from the venv's own script, in that folder
    listing = _sh(str(venv / "bin" / "hybridckpt"), "inspect", sample_path(), cwd=user, env=env)
    assert "config:    {\"family\": \"llama\"" in listing
    assert _sh(py, "-m", "hybridckpt", "--version", cwd=user, env=env).strip() == f"hybridckpt {hybridckpt.__version__}"


def test_the_package_needs_none_of_the_test_only_libraries(tmp_path):
    """An import, an inspect and an export of the sample run with torch, transformers and the
    safetensors library unimportable: the package reads and writes safetensors itself (the
    library is the tests' second reader, in the test extra, not a dependency)."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    for name in ("torch", "transformers", "safetensors", "deepspeed", "paddle", "megatron"):
        (blocker / f"{name}.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    code = (
        "import sys, hybridckpt\n"
        "from hybridckpt.demo import sample_path\n"
        "from hybridckpt import jobs\n"
        f"jobs.import_checkpoint(sample_path(), {str(tmp_path / 'ck')!r})\n"
        f"jobs.export_checkpoint({str(tmp_path / 'ck')!r}, {str(tmp_path / 'hf')!r})\n"
        "bad = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), ROOT, os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}
    assert _sh(sys.executable, "-c", code, env=env, cwd=str(tmp_path)).strip().endswith("ok")
    assert sorted(os.listdir(tmp_path / "hf"))[:1] and any(n.endswith(".safetensors") for n in os.listdir(tmp_path / "hf"))
