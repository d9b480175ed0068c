"""The layers of the code base (README "Architecture"): a module imports only from its own layer
or the layers below it, and `models` imports nothing from `hybridckpt`. Read from the source
(every `import` statement, including those inside functions), so a new edge that breaks the
picture fails here, not in review."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS: list[tuple[str, ...]] = [
    ("models.errors", "hybridckpt.errors"),
    ("models", "hybridckpt.io.byte_source", "hybridckpt.io.writeback"),
    ("hybridckpt.lazy",),
    ("hybridckpt.rules", "hybridckpt.checksum", "hybridckpt.io", "hybridckpt.optim", "hybridckpt.source"),
    ("hybridckpt.formats",),
    ("hybridckpt.naming",),
    ("hybridckpt.mesh", "hybridckpt.plan", "hybridckpt.place"),
    ("hybridckpt.store",),
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
    for top in ("hybridckpt", "models"):
        for root, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield rel.removesuffix(".__init__"), path


def _imports(path: str, module: str):
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
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
                yield full if os.path.exists(os.path.join(ROOT, *full.split("."))) or os.path.exists(
                    os.path.join(ROOT, *full.split(".")) + ".py") else base


def test_every_import_goes_down_or_sideways():
    bad = []
    for module, path in _modules():
        mine = layer_of(module)
        assert mine is not None, module
        for target in _imports(path, module):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not bad, "\n".join(bad)


def test_models_never_import_hybridckpt():
    bad = [
        f"{m} imports {t}"
        for m, p in _modules()
        if m.startswith("models")
        for t in _imports(p, m)
        if t.startswith("hybridckpt")
    ]
    assert not bad, bad


def test_the_check_can_fail():
    assert layer_of("hybridckpt.jobs.export") > layer_of("hybridckpt.formats.dcp.reader")
    assert layer_of("hybridckpt.io.byte_source") < layer_of("hybridckpt.lazy.views") < layer_of("hybridckpt.io.pickle")
