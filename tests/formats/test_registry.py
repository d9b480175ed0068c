"""The one registry of formats (`hybridckpt.formats.registry`): a format is its package and one
line; `--format` and `--to` come from it; a writer's options are its own (others refused)."""

from __future__ import annotations

import ast
import dataclasses
import os

import numpy as np
import pytest

from hybridckpt.cli import main
from hybridckpt.errors import ConfigError
from hybridckpt.formats import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _with_toy(monkeypatch):
    """The registry as it is plus ONE line: the toy format (tests/fixtures/toy_format.py)."""
    toy = registry.Format("toy-npz", "fixtures.toy_format:detect", "fixtures.toy_format:open",
                          write="fixtures.toy_format:write")
    formats = (toy, *registry.FORMATS)
    readable = tuple(f for f in formats if f.open is not None)
    writable = {**registry.WRITABLE, "toy-npz": toy}
    monkeypatch.setattr(registry, "FORMATS", formats)
    monkeypatch.setattr(registry, "READABLE", readable)
    monkeypatch.setattr(registry, "NAMES", tuple(f.name for f in readable))
    monkeypatch.setattr(registry, "WRITABLE", writable)
    monkeypatch.setattr(registry, "TO_NAMES", tuple(writable))


def test_a_new_format_is_one_registry_line(tmp_path, monkeypatch, capsys):
    """With the one line added, every command finds the toy format: inspect detects it, export
    reads it and writes it back through its writer, `--format`/`--to` accept its name; without the
    line the CLI refuses it (exit 2), so the line is what makes it a format."""
    src = str(tmp_path / "in.npz")
    arrays = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int64)}
    np.savez(src, **arrays)
    assert main(["export", src, str(tmp_path / "no"), "--to", "toy-npz", "--quiet"]) == 2
    _with_toy(monkeypatch)
    assert main(["inspect", src]) == 0 and "toy-npz" in capsys.readouterr().out
    out = str(tmp_path / "out")
    assert main(["export", src, out, "--format", "toy-npz", "--to", "toy-npz", "--quiet"]) == 0
    with np.load(os.path.join(out, "arrays.npz")) as back:
        assert sorted(back.files) == sorted(arrays)
        for k, v in arrays.items():
            assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes()
    assert main(["export", src, str(tmp_path / "hf"), "--quiet"]) == 0  # and into every other format
    assert os.path.isfile(os.path.join(tmp_path, "hf", "model.safetensors"))


@pytest.mark.parametrize(("to", "flag"), [("hf", ["--tp", "2"]), ("hf", ["--tp", "1"]), ("dcp", ["--pp", "2"]),
                                          ("hf", ["--writers", "2"]), ("megatron", ["--writers", "2"]),
                                          ("dcp", ["--no-scan-layers"]), ("hf", ["--scan-layers"])])
def test_a_writer_option_another_format_does_not_take_is_refused(tmp_path, capsys, to, flag):
    """`--tp`, `--pp`, `--writers`, `--[no-]scan-layers` are options of the formats whose registry
    line declares them; given for another `--to`, one line and exit 2 before the source is opened,
    nothing written (before:
    `--no-scan-layers` and `--tp 1` were accepted and ignored)."""
    src, out = str(tmp_path / "in.npz"), tmp_path / "out"
    np.savez(src, w=np.zeros((2, 2), np.float32))  # (no format reads it: refused before it is opened)
    code = main(["export", src, str(out), "--to", to, *flag, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "only for --to" in err and f"(not --to {to})" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_the_library_refuses_them_too():
    with pytest.raises(ConfigError, match=r"--tp: only for --to megatron \(not --to dcp\)"):
        registry.write(dataclasses.replace(_request(), layout="dcp", options={"tp": 2}))


def _request():
    from hybridckpt.writers import ExportRequest

    return ExportRequest("hf", "/nonexistent/out", None)


def test_the_cli_lists_the_registry_not_its_own_names():
    from hybridckpt.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices  # noqa: SLF001 - argparse's
    to = next(a for a in sub["export"]._actions if a.dest == "to")  # noqa: SLF001
    fmt = next(a for a in sub["export"]._actions if a.dest == "format")  # noqa: SLF001
    assert list(to.choices) == list(registry.TO_NAMES) and list(fmt.choices) == ["auto", *registry.NAMES]
    for f in registry.WRITABLE.values():
        assert f.about and f.about in " ".join(to.help.split())


def test_the_export_job_names_no_format():
    """jobs/export.py carries no format's name but the default target's, and no writer option."""
    tree = ast.parse(open(os.path.join(ROOT, "hybridckpt", "jobs", "export.py"), encoding="utf-8").read())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    names = {f.name for f in registry.FORMATS} | set(registry.TO_NAMES)
    options = {k for f in registry.FORMATS for k in f.options}
    assert strings & names == {"hf"} and not strings & options, strings & (names | options)
