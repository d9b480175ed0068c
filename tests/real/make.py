"""Write the real-tool fixture corpus: each case is written by the tool itself, in a side venv.

    python tests/real/make.py GENERATOR [--venv DIR] [--python 3.12] [--keep]
    python tests/real/make.py --list

A generator is `tests/real/generators/<name>.py` beside `<name>.requirements.txt` (exact pins;
a first line `# python: 3.12` picks the interpreter, found through pyenv or on PATH). This script
makes (or reuses) the side venv `--venv` (default `~/.cache/hybridckpt-real/<name>`), installs the
pins there, and runs the generator with that venv's Python as

    <venv>/bin/python tests/real/generators/<name>.py --out tests/real/cases

The generator writes one folder per case, `tests/real/cases/<case>/`, holding the files the tool
wrote (`ckpt/`), the references taken from the tool's own runtime (`reference.safetensors`: params,
moments, logits, gradients, the next step's params, as float32 or the stored dtype), and
`manifest.json` (`tools.record_manifest`: tool versions, Python, the command, what each reference
key is). Nothing here runs in CI: the suite reads the committed cases (`tests/real/test_*.py`
through `tests/real/cases.py`). The corpus budget is in the README (tests/real/README.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATORS = os.path.join(HERE, "generators")
CASES = os.path.join(HERE, "cases")


def generators() -> list[str]:
    return sorted(f[: -len(".py")] for f in os.listdir(GENERATORS) if f.endswith(".py") and not f.startswith("_"))


def python_for(requirements: str, override: str | None) -> str:
    """The interpreter for the venv: `--python`, else the requirements' `# python: X.Y` line,
    else this one."""
    want = override
    if want is None:
        with open(requirements) as f:
            first = f.readline().strip()
        if first.startswith("# python:"):
            want = first.split(":", 1)[1].strip()
    if want is None:
        return sys.executable
    for cand in (shutil.which(f"python{want}"), os.path.expanduser(f"~/.pyenv/versions/{want}/bin/python")):
        if cand and os.path.exists(cand):
            return cand
    pyenv_root = os.path.expanduser("~/.pyenv/versions")
    for v in sorted(os.listdir(pyenv_root)) if os.path.isdir(pyenv_root) else []:
        if v.startswith(want + "."):
            return os.path.join(pyenv_root, v, "bin", "python")
    raise SystemExit(f"make.py: no Python {want} found (pyenv install {want}, or --python)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("generator", nargs="?", help="one of --list")
    ap.add_argument("--list", action="store_true", help="list the generators")
    ap.add_argument("--venv", help="the side venv (default ~/.cache/hybridckpt-real/GENERATOR)")
    ap.add_argument("--python", help="the interpreter version for a new venv (default: the requirements' line)")
    ap.add_argument("--no-install", action="store_true", help="use the venv as it is")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the generator")
    a = ap.parse_args(argv)
    if a.list or not a.generator:
        print("\n".join(generators()))
        return 0
    if a.generator not in generators():
        raise SystemExit(f"make.py: no generator {a.generator!r}; one of: {', '.join(generators())}")
    req = os.path.join(GENERATORS, f"{a.generator}.requirements.txt")
    venv = a.venv or os.path.expanduser(f"~/.cache/hybridckpt-real/{a.generator}")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([python_for(req, a.python), "-m", "venv", venv], check=True)
    if not a.no_install:
        subprocess.run([py, "-m", "pip", "install", "-q", "-r", req], check=True)
    env = dict(os.environ, PYTHONPATH=HERE)  # generators import `tools` (tests/real/tools.py)
    cmd = [py, os.path.join(GENERATORS, f"{a.generator}.py"), "--out", CASES, *a.args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
