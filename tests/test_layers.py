"""The layers of the code base (docs/design.md "Architecture"): folders are the layers, and a module
imports only from its own layer or the layers below it. Read from the source: every `import`
statement (those inside functions too) and every module named by a string to `importlib`
(`import_module("hybridckpt...")` or a registry's `("name", "hybridckpt.x.y")` entry), so a new
edge that breaks the picture fails here, not in review. The model families (`hybridckpt.models`,
the repository's `models/` folder) import nothing of `hybridckpt` but its errors."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# bottom to top: the folders (and the few single modules) of each layer; a module belongs to the
# layer of its longest matching prefix
LAYERS: list[tuple[str, ...]] = [
    ("hybridckpt.errors",),
    ("hybridckpt.io", "hybridckpt.models"),  # bytes and files; the families (JAX-free parts first)
    ("hybridckpt.lazy", "hybridckpt.values"),  # the lazy tensor protocol, every generic view, the reader pool; values read from files, type-checked
    ("hybridckpt.containers",),  # file containers: restricted pickles, safetensors, DCP metadata, Orbax's files
    ("hybridckpt.rules", "hybridckpt.optim", "hybridckpt.checksum", "hybridckpt.source_checkpoint"),
    ("hybridckpt.naming", "hybridckpt.mesh", "hybridckpt.mesh_shape", "hybridckpt.plan", "hybridckpt.place"),
    ("hybridckpt.writers",),  # what a writer is asked, and the one destination helper
    ("hybridckpt.store",),  # our Orbax checkpoints: the store, the streaming save
    ("hybridckpt.formats",),  # every format, ours included: its reader, its writer, the one registry
    ("hybridckpt.jobs",),
    ("hybridckpt.cli", "hybridckpt.demo", "hybridckpt"),
]


def layer_of(module: str) -> int | None:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    return level


def _modules():
    for top, package in (("hybridckpt", "hybridckpt"), ("models", "hybridckpt.models")):
        base = os.path.join(ROOT, top)
        for root, _, files in os.walk(base):  # (hybridckpt/models is a link to models/: not followed)
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                    yield f"{package}.{rel}".removesuffix(".__init__").removesuffix("."), path


def _exists(module: str) -> bool:
    parts = module.split(".")
    if parts[:2] == ["hybridckpt", "models"]:
        parts = ["models", *parts[2:]]
    path = os.path.join(ROOT, *parts)
    return os.path.isdir(path) or os.path.exists(path + ".py")


_NAMED = re.compile(r"""["'](hybridckpt(?:\.\w+)+)["']""")


def imports_of(source: str, module: str, is_package: bool):
    """Every module `source` imports, by statement or by a string naming a module of ours."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # `from pkg import mod` imports pkg.mod when it is a module
                full = f"{base}.{a.name}"
                yield full if _exists(full) else base
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in _NAMED.finditer(f'"{node.value}"'):
                name = m.group(1).split(":")[0]
                if _exists(name):
                    yield name


def violations(modules) -> list[str]:
    bad = []
    for module, path in modules:
        mine = layer_of(module)
        assert mine is not None, module
        source = open(path, encoding="utf-8").read()
        for target in imports_of(source, module, path.endswith("__init__.py")):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
            if module.startswith("hybridckpt.models") and target.startswith("hybridckpt") and not (
                    target.startswith("hybridckpt.models") or target == "hybridckpt.errors"):
                bad.append(f"{module}: a model family imports {target}")
            if target == "models" or target.startswith("models."):
                bad.append(f"{module} imports a top-level `models` (it is `hybridckpt.models`)")
    return bad


def test_every_import_goes_down_or_sideways():
    bad = violations(_modules())
    assert not bad, "\n".join(bad)


def test_the_check_catches_an_upward_import_and_an_importlib_string(tmp_path):
    """The checker fed modules that break the picture: a format importing a job, a lazy view
    importing a format by an importlib string, a family importing the jobs."""
    cases = {
        "hybridckpt.formats.evil": "from hybridckpt.jobs import export_checkpoint\n",
        "hybridckpt.lazy.evil": "import importlib\nimportlib.import_module('hybridckpt.formats.dcp')\n",
        "hybridckpt.models.evil": "def f():\n    from hybridckpt import jobs\n",
        "hybridckpt.io.evil": "import models\n",
    }
    modules = []
    for module, text in cases.items():
        path = tmp_path / f"{module}.py"
        path.write_text(text)
        modules.append((module, str(path)))
    bad = violations(modules)
    for module in cases:
        assert any(b.startswith(module) for b in bad), (module, bad)
    assert violations([("hybridckpt.jobs.fine", _write(tmp_path, "from hybridckpt.store import x\n"))]) == []


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "fine.py"
    path.write_text(text)
    return str(path)


def test_the_registry_names_each_reader_by_its_own_name():
    from hybridckpt.formats import registry

    for f in registry.READABLE:
        assert f.reader.NAME == f.name
        assert f.detect.partition(":")[0] == f.open.partition(":")[0]  # one module: detect, open, steps


def test_every_writer_and_reader_the_registry_names_exists():
    import importlib

    from hybridckpt.formats import registry

    for f in registry.FORMATS:
        for where in (f.detect, f.open, f.write):
            if where is not None:
                module, _, function = where.partition(":")
                assert callable(getattr(importlib.import_module(module), function)), where
