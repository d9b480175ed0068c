"""Which tests build meshes of several devices: a scan of the test files' source (no imports).

These tests (pytest's `multidevice` marker, given by tests/conftest.py) are the ones to rerun
on 4, 2 and 1 devices, where a mesh that does not fit or an expectation written for 8 devices
fails (docs/testing.md). The README's test command runs the whole suite on 8 devices, then a
representative part of them (`RERUN`, the `multidevice_rerun` marker) on 4 and on 2.

A test is multi-device when its function (decorators included), a fixture it uses, or a name it
refers to mentions, directly or through other such names:
- a mesh as text with an axis > 1 ("tp=2", "fsdp=2,tp=2,pp=2"), except as the argument of
  `abstract_mesh` (a mesh without devices: rule tests, the same on any device count) or of
  `meshes.spec` (a PartitionSpec named on a mesh given as text);
- a call of `make_mesh`, `mesh_from_shape`, `fit`, `fit_pair`, `fit_mesh`, `cases`,
  `device_count` or `devices` (jax's).
Names are followed within the test file, into the names it imports from the helper files of
tests/ (`e2e.roundtrip` fits meshes: its callers are multi-device), and into the fixtures of
tests/conftest.py files. A test can also be marked by hand (`@pytest.mark.multidevice`).

A test this scan misses cannot pass unnoticed: tests/conftest.py fails an unmarked test that
builds a mesh of several devices through `hybridckpt.mesh.make_mesh` (`MeshGuard`).
"""

from __future__ import annotations

import ast
import functools
import os
import re

MESH_TEXT = re.compile(r"(?:dp|fsdp|tp|pp)=\d+(?:,(?:dp|fsdp|tp|pp)=\d+)*")
MESH_CALLS = frozenset(
    {"make_mesh", "mesh_from_shape", "fit", "fit_pair", "fit_mesh", "cases", "device_count", "devices"}
)
MESH_MODULES = frozenset({"meshes", "jax", "mesh"})

# The files whose multidevice tests the README's command reruns on 4 and 2 devices (marker
# `multidevice_rerun`): each mechanism by which a test adapts, in files whose meshes change shape
# between 8, 4 and 2 devices, about a sixth of the multidevice tests' time (docs/testing.md).
RERUN = (
    "test_meshes.py",  # fit / fit_pair / the guard themselves
    "test_mesh.py",  # make_mesh on the devices present, a mesh too big refused
    "families/test_models.py",  # sharded forward and AdamW step on fit_mesh, spec() per mesh
    "store/test_restore.py",  # restore onto parametrized cases(), sizes per count
    "store/test_streaming.py",  # fit_pair reshards of the store, streamed reads per box
    "formats/test_megatron.py",  # e2e.roundtrip (fit_pair) over cases() of mesh pairs
    "formats/test_flex_checkpoint.py",  # the same for Paddle's FlexCheckpoint
    "formats/test_mixtral_native.py",  # MoE: keep="dp", the expert axis kept first
    "formats/test_hf.py",  # the CLI's --strict-sharding refusals, branching on the count
    "jobs/test_model_agnostic.py",  # its own meshes per count, restores bitwise onto each
    "jobs/test_multiprocess.py",  # 2 processes with half the devices each
    "real/test_real_hf_legacy.py",  # the real-tool cases' mesh_pair (roundtrip_real)
    "test_hostile.py",  # the CLI on a fitted --mesh; the damaged store on the pair fit_pair gives
)
NO_DEVICES = frozenset({"abstract_mesh", "spec"})  # their mesh literal is shapes only


def _name_of_call(node: ast.Call) -> str | None:
    """`fit` of `fit(...)`; of `x.attr(...)` the attr where x is one of the modules of meshes
    (`meshes.fit`, `jax.devices`, `mesh.make_mesh`), else None (`attacks.cases()` is not ours)."""
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in MESH_MODULES:
        return f.attr
    return None


def _direct(node: ast.AST) -> bool:
    """Whether `node` mentions a multi-device mesh literal or a mesh-building call itself."""
    skip: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = _name_of_call(n)
            if name in NO_DEVICES:
                skip.update(id(a) for a in ast.walk(n))
            elif name in MESH_CALLS:
                return True
    for n in ast.walk(node):
        if id(n) in skip or not (isinstance(n, ast.Constant) and isinstance(n.value, str)):
            continue
        if MESH_TEXT.fullmatch(n.value) and any(int(p.partition("=")[2]) > 1 for p in n.value.split(",")):
            return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level names -> the statement defining them (functions, classes, assignments)."""
    out: dict[str, ast.AST] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[stmt.name] = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = stmt
    return out


def _helper_file(module: str, here: str, tests: str) -> str | None:
    """The file of `from module import ...` when it is a helper of the test suite."""
    for base in (here, tests):
        stem = os.path.join(base, *module.split("."))
        for path in (stem + ".py", os.path.join(stem, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


_VISITING: set[str] = set()  # files whose names are being found (helper files importing each other)


@functools.cache
def mesh_names(path: str, tests: str) -> frozenset[str]:
    """The module-level names of the file at `path` that are multi-device (module docstring),
    including the names it imports from tests/ helper files that are (a file met again while its
    own names are being found gives none there: an import cycle)."""
    if path in _VISITING:
        return frozenset()
    _VISITING.add(path)
    try:
        return _mesh_names(path, tests)
    finally:
        _VISITING.discard(path)


def _mesh_names(path: str, tests: str) -> frozenset[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    here = os.path.dirname(os.path.abspath(path))
    marked: set[str] = set()
    for stmt in tree.body:  # imported from the suite's own helper files
        if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
            helper = _helper_file(stmt.module, here, tests)
            if helper:
                helper = os.path.abspath(helper)
                theirs = mesh_names(helper, tests)
                marked.update(a.asname or a.name for a in stmt.names if a.name in theirs)
    defs = _top_level(tree)
    marked.update(name for name, stmt in defs.items() if _direct(stmt))
    while True:  # names that refer to marked names
        more = {name for name, stmt in defs.items() if name not in marked and _names(stmt) & marked}
        if not more:
            return frozenset(marked)
        marked |= more


def _conftests(path: str, tests: str) -> list[str]:
    """The conftest.py files from tests/ down to the folder of `path`."""
    out, folder = [], os.path.abspath(os.path.dirname(path))
    root = os.path.abspath(tests)
    while folder.startswith(root):
        if os.path.isfile(os.path.join(folder, "conftest.py")):
            out.append(os.path.join(folder, "conftest.py"))
        if folder == root:
            break
        folder = os.path.dirname(folder)
    return out


def is_multidevice(path: str, function: str, fixtures: tuple[str, ...], tests: str) -> bool:
    """Whether the test `function` of the file at `path`, using `fixtures`, is multi-device."""
    names = mesh_names(path, tests)
    if function in names:
        return True
    fixture_names = set(names)
    for conftest in _conftests(path, tests):
        fixture_names |= mesh_names(conftest, tests)
    return any(f in fixture_names for f in fixtures)


def is_rerun(path: str, tests: str) -> bool:
    """Whether the test file at `path` is one of `RERUN` (paths relative to tests/)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(tests)).replace(os.sep, "/")
    return rel in RERUN
