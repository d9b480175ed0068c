"""The README as a new user meets it: it starts with its two set-up commands; its quick start runs
as written (the shell block with `SRC` the built-in sample, then the Python block in the same
folder); every other Python block runs as written in a fresh interpreter, in an empty folder, on a
CPU-only machine; its command table and docs/cli.md name every option the command line has; its
links to docs/ lead somewhere."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from hybridckpt.demo import sample_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
QUICK_START = "## Quick start"


def _text(path: str = README) -> str:
    return open(path, encoding="utf-8").read()


def _section(title: str) -> str:
    """The README's `## title...` section, up to the next `## ` heading."""
    text = _text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _blocks(text: str, lang: str = "python") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if os.environ.get("HYBRIDCKPT_TEST_PLATFORM", "cpu") == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return env


def test_the_readme_has_python_blocks_and_its_two_setup_commands():
    text = _text()
    setup = re.search(r"```\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert len(setup) == 2 and setup[0].endswith("hybridckpt demo") and "[test]" in setup[1]
    assert text.index("```\n") < text.index("## What it does")  # the first thing a reader sees
    assert _blocks(text)


def test_the_quick_start_runs_as_written(tmp_path):
    section = _section(QUICK_START)
    shell, python = _blocks(section, "sh"), _blocks(section)
    assert len(shell) == 1 and len(python) == 1, "the quick start is one shell block and one Python block"
    env = _env() | {"SRC": sample_path(), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    r = subprocess.run(["bash", "-e", "-c", shell[0]], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, f"quick start shell block failed:\n{shell[0]}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "items match" in r.stdout and (tmp_path / "hf-out" / "generation_config.json").is_file()
    r = subprocess.run([sys.executable, "-c", python[0]], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, f"quick start Python block failed:\n{python[0]}\n{r.stderr[-3000:]}"
    assert r.stdout.startswith("LlamaConfig\n12 mesh changed"), r.stdout


def test_every_other_python_block_runs_verbatim(tmp_path):
    text = _text()
    quick = _blocks(_section(QUICK_START))
    blocks = [b for b in _blocks(text) if b not in quick]
    assert blocks
    for i, code in enumerate(blocks):
        work = tmp_path / f"block{i}"
        work.mkdir()
        r = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True,
                           env=_env(), timeout=300)
        assert r.returncode == 0, f"README block {i} failed:\n{code}\n{r.stderr[-3000:]}"


def _options() -> dict[str, list[argparse.Action]]:
    """Each command's documented options (not --help, --debug or hidden ones)."""
    from hybridckpt.cli.parser import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: [a for a in p._actions if a.option_strings and a.help != argparse.SUPPRESS
                   and a.option_strings[-1] not in ("--help", "--debug")]
            for name, p in sub.choices.items()}


def test_the_command_table_and_docs_cli_name_every_option():
    """The README's command table gives each command's whole synopsis (its row names every option
    and every choice of a short choice list), and docs/cli.md explains each option."""
    rows = {m.group(1): line for line in _section("## Commands").splitlines()
            if (m := re.match(r"^\| `hybridckpt (\w+)", line))}
    cli = _text(os.path.join(ROOT, "docs", "cli.md"))
    options = _options()
    assert sorted(rows) == sorted(options)
    for command, actions in options.items():
        for a in actions:
            flag = a.option_strings[-1]
            assert flag in rows[command], f"README: `hybridckpt {command}` row lacks {flag}"
            assert f"`{flag}" in cli, f"docs/cli.md does not explain {flag}"
            if a.choices and flag != "--format":
                for choice in a.choices:
                    assert choice in rows[command], f"README: `{command} {flag}` lacks the choice {choice}"


def test_docs_cli_gives_the_inspect_json_schema_and_every_link_leads_somewhere():
    from hybridckpt.jobs.inspect import SCHEMA

    cli = _text(os.path.join(ROOT, "docs", "cli.md"))
    table = cli[cli.index("## inspect --json"):]
    assert [m for m in re.findall(r"^\| `(\w+)` \|", table, re.M)] == list(SCHEMA)
    for source in (README, *(os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")))):
        for link in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", _text(source)):
            assert os.path.isfile(os.path.join(os.path.dirname(source), link)), (source, link)
