"""Write the export-check records again: our export of a case, then the real tool loading it.

    python tests/real/rerun_export_checks.py [NAME ...] [--venv-root DIR]   # in the project venv
    python tests/real/rerun_export_checks.py --list

For each record `export_checks/NAME.json` (all of them without a NAME): the two `hybridckpt`
command lines of `CHECKS[NAME]` (`export_digest.commands`: import the corpus case, export it with
the check's options) run here, in the project venv, into a temporary folder; then the check script
runs in its generator's side venv (`DIR/<generator>/bin/python`, default
`~/.cache/hybridckpt-real/<generator>`, made by `python tests/real/make.py <generator>`) with
`--ours` that folder, `--record export_checks/NAME.json` and `--export-commands` the command
lines, so the record holds them and the export's digest (`export_digest.digest`). The tests
(`test_real_export_*.py`) run the same command lines with the code of the day and fail when the
digest differs: the record is then about another export, and this script writes it again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import export_digest  # noqa: E402


@dataclass(frozen=True)
class Check:
    """One record: the check `script` (in `generators/`) of the side venv `generator`, the corpus
    case `source` exported with `export_args`, and the script's own arguments."""

    generator: str
    script: str
    source: str
    export_args: tuple[str, ...]
    script_args: tuple[str, ...] = ()


_TITAN = ("--to", "torchtitan", "--optimizer")
_TT_CHECK = "_torchtitan_check_export.py"
_MEG_CHECK, _MEG_FOREIGN = "_megatron_core_check_export.py", "_megatron_core_check_foreign.py"
CHECKS = {
    "torchtitan_llama3_world1": Check("torchtitan", _TT_CHECK, "torchtitan_llama3", _TITAN,
                                      ("--case", "torchtitan_llama3", "--world", "1")),
    "torchtitan_llama3_world4": Check("torchtitan", _TT_CHECK, "torchtitan_llama3", _TITAN,
                                      ("--case", "torchtitan_llama3", "--world", "4")),
    "torchtitan_qwen3_world1": Check("torchtitan", _TT_CHECK, "torchtitan_qwen3", _TITAN,
                                     ("--case", "torchtitan_qwen3", "--world", "1")),
    "megatron_core_dense_tp2pp2": Check("megatron_core", _MEG_CHECK, "megatron_core_dense_fully_reshardable",
                                        ("--to", "megatron", "--optimizer", "--tp", "2", "--pp", "2")),
    "megatron_core_from_torchtitan_qwen3_pp2": Check("megatron_core", _MEG_FOREIGN, "torchtitan_qwen3",
                                                     ("--to", "megatron", "--optimizer", "--pp", "2")),
    "megatron_core_from_torchtitan_qwen3_tp2": Check("megatron_core", _MEG_FOREIGN, "torchtitan_qwen3",
                                                     ("--to", "megatron", "--optimizer", "--tp", "2")),
}  # fmt: skip


def _hybridckpt(argv: list[str]) -> int:
    print("+ hybridckpt", " ".join(argv), flush=True)
    return subprocess.run(
        [sys.executable, "-m", "hybridckpt.cli", *argv], cwd=export_digest.ROOT
    ).returncode


def rerun(name: str, venv_root: str, work: str) -> int:
    """Export, check, record `name`; the check script's exit status."""
    c = CHECKS[name]
    cmds = export_digest.commands(c.source, list(c.export_args))
    ours = export_digest.Exports(_hybridckpt, os.path.join(work, name)).make(cmds)
    py = os.path.join(venv_root, c.generator, "bin", "python")
    if not os.path.exists(py):
        raise SystemExit(f"{py}: no side venv (python tests/real/make.py {c.generator} makes it)")
    cmd = [py, os.path.join(HERE, "generators", c.script), "--ours", ours, *c.script_args,
           "--exported-with", " ".join(c.export_args), "--export-commands", json.dumps(cmds),
           "--record", os.path.join(HERE, "export_checks", f"{name}.json")]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=HERE)).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="records to write again (default: all)")
    ap.add_argument("--list", action="store_true", help="list the records")
    ap.add_argument("--venv-root", default=os.path.expanduser("~/.cache/hybridckpt-real"),
                    help="where the side venvs are (default ~/.cache/hybridckpt-real)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(CHECKS))
        return 0
    unknown = [n for n in a.names if n not in CHECKS]
    if unknown:
        raise SystemExit(
            f"rerun_export_checks.py: no record {unknown[0]!r}; one of: {', '.join(CHECKS)}"
        )
    failed = []
    for name in a.names or list(CHECKS):
        work = tempfile.mkdtemp(prefix="export-check-")
        try:
            if rerun(name, a.venv_root, work):
                failed.append(name)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print("FAILED: " + ", ".join(failed) if failed else "all records written")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
