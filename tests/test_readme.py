"""The README's Python blocks run as written, in a fresh interpreter on a CPU-only machine, in an
empty folder (what a new user does with them); the README starts with its two set-up commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), re.S)


def test_the_readme_has_python_blocks_and_its_two_setup_commands():
    text = open(README, encoding="utf-8").read()
    setup = re.search(r"```\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert len(setup) == 2 and setup[0].endswith("hybridckpt demo") and "[test]" in setup[1]
    assert _blocks()


def test_every_python_block_runs_verbatim(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if os.environ.get("HYBRIDCKPT_TEST_PLATFORM", "cpu") == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    for i, code in enumerate(_blocks()):
        work = tmp_path / f"block{i}"
        work.mkdir()
        r = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == 0, f"README block {i} failed:\n{code}\n{r.stderr[-3000:]}"
