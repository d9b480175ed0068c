"""The digest an export-check record pins, and how the record's export is made (standard library
only: the check scripts import it in their side venvs, the tests in the project venv; no torch,
no hybridckpt).

An export check (`generators/_*_check_*.py`) has a real tool load a folder our
`hybridckpt export` wrote; its record (`export_checks/NAME.json`) says what the tool found. The
record is about THAT folder, so it carries

    "export": {"commands": [IMPORT_ARGV, EXPORT_ARGV], "digest": "sha256:..."}

`commands` are the two `hybridckpt` command lines that made it (`ORBAX` / `OURS` stand for the
temporary folders) and `digest` is `digest(OURS)`. `test_real_export_*.py` run the same commands
with today's code and compare the digests: any change in what the export writes makes the
record stale, and the test says to rerun the check (`rerun_command`).

`digest(folder)`: SHA-256 over every file of the folder, sorted by relative path (`/`-joined),
each as its path and the SHA-256 of its content, where the content is the file's bytes except:
- our marker `.hybridckpt-export` is left out: it names hybridckpt's version and the files, no
  tool reads it, and a version bump changes nothing a tool loads;
- a DCP `.metadata` (torch's pickle of `Metadata`) is digested as its object graph (every class
  name, constructor argument and state, in the pickle's order) with the two fields that differ
  from one save to the next blanked: `StorageMeta.checkpoint_id` (the absolute path it was
  written to) and `StorageMeta.save_id` (a random uuid). Nothing in the pickle is run: every
  global it names becomes an inert placeholder (`_Obj`) that records its arguments.
Two exports of the same source with the same options give the same digest whatever the mesh or
the folder (looked at: every other file, `.distcp` data, Megatron's `metadata.json`, common state
and `latest_checkpointed_iteration.txt`, is byte-identical between such runs).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from collections.abc import Callable

MARKER = ".hybridckpt-export"
DCP_METADATA = ".metadata"
VARYING = {"checkpoint_id", "save_id"}  # StorageMeta fields that differ per save
ORBAX, OURS = "ORBAX", "OURS"  # the placeholders of `commands`
MAX_FILES = 10_000
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository


class _Obj:
    """A global the pickle names (class or function), never imported: calling, `__new__` and
    BUILD only record what they were given."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state


class _Inert(pickle.Unpickler):
    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = type(name, (_Obj,), {"qualname": f"{module}.{name}"})
        return self._classes[key]

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"persistent id {pid!r} in a DCP .metadata")


def _canon(x):
    """A JSON-able image of an unpickled value: type names kept, dict and sequence order kept,
    StorageMeta's per-save fields blanked."""
    if isinstance(x, _Obj):
        state = x.state
        if x.qualname.endswith(".StorageMeta") and isinstance(state, dict):
            state = {k: "(varies per save)" if k in VARYING else v for k, v in state.items()}
        return ["obj", x.qualname, _canon(x.args), _canon(state)]
    if isinstance(x, type) and issubclass(x, _Obj):  # a global named as a value: torch.float32
        return ["global", x.qualname]
    if isinstance(x, dict):
        return ["dict", [[_canon(k), _canon(v)] for k, v in x.items()]]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [_canon(v) for v in x]]
    if isinstance(x, (bytes, bytearray)):
        return ["bytes", bytes(x).hex()]
    if x is None or isinstance(x, (bool, int, str)):
        return [type(x).__name__, x]
    if isinstance(x, float):
        return ["float", x.hex()]
    raise ValueError(f"unexpected {type(x).__name__} in a DCP .metadata")


def metadata_image(data: bytes) -> bytes:
    """The bytes a DCP `.metadata` pickle is digested as (see the module doc)."""
    top = _Inert(data).load()
    if not (isinstance(top, _Obj) and top.qualname.endswith(".Metadata")):
        raise ValueError("a .metadata that is not a DCP Metadata object")
    return json.dumps(_canon(top), separators=(",", ":")).encode()


def digest(folder: str) -> str:
    """`sha256:<hex>` of the export in `folder` (see the module doc)."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/")
            if rel != MARKER:
                files.append(rel)
        if len(files) > MAX_FILES:
            raise ValueError(f"{folder}: more than {MAX_FILES} files")
    h = hashlib.sha256()
    for rel in sorted(files):
        with open(os.path.join(folder, rel), "rb") as f:
            data = f.read()
        if os.path.basename(rel) == DCP_METADATA:
            data = metadata_image(data)
        h.update(json.dumps([rel, hashlib.sha256(data).hexdigest()]).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def commands(source: str, export_args: list[str]) -> list[list[str]]:
    """The `hybridckpt` command lines that import the corpus case `source` (with its
    `config.json` where it has one) into ORBAX and export ORBAX into OURS with `export_args`."""
    case = f"tests/real/cases/{source}"
    imp = ["import", f"{case}/ckpt", ORBAX]
    if os.path.exists(os.path.join(HERE, "cases", source, "config.json")):
        imp += ["--config", f"{case}/config.json"]
    return [imp, ["export", ORBAX, OURS, *export_args]]


def record(cmds: list[list[str]], ours: str) -> dict:
    """The `export` entry of a check's record: the commands that made `ours` and its digest."""
    return {"commands": cmds, "digest": digest(ours)}


class Exports:
    """The exports records' `commands` make, with today's code: `run(argv)` runs one hybridckpt
    command line and returns its exit status (the CLI's `main` in the tests, a subprocess in
    rerun_export_checks.py); folders under `workdir`, each distinct import and export made once
    (callers copy a folder before changing it)."""

    def __init__(self, run: Callable[[list[str]], int], workdir: str, _imports: dict | None = None):
        self.run, self.workdir = run, workdir
        self._imports = {} if _imports is None else _imports
        self._exports: dict[str, str] = {}

    def with_run(self, run: Callable[[list[str]], int]) -> Exports:
        """The same imports, exports made by `run` (a mutation of the export, in the tests)."""
        return Exports(run, self.workdir, self._imports)

    def _bind(self, argv: list[str], orbax: str, ours: str) -> list[str]:
        where = {ORBAX: orbax, OURS: ours}
        return [
            where.get(a) or (os.path.join(ROOT, a) if a.startswith("tests/real/cases/") else a)
            for a in argv
        ]

    def make(self, cmds: list[list[str]]) -> str:
        """The folder the command lines `cmds` (import, export) export into."""
        imp, exp = cmds
        key = json.dumps(imp)
        if key not in self._imports:
            orbax = os.path.join(self.workdir, f"orbax{len(self._imports)}")
            if self.run(self._bind(imp, orbax, "")) != 0:
                raise AssertionError(f"hybridckpt {' '.join(imp)} failed")
            self._imports[key] = orbax
        key = json.dumps(cmds)
        if key not in self._exports:
            ours = os.path.join(self.workdir, f"ours{len(os.listdir(self.workdir))}")
            if self.run(self._bind(exp, self._imports[json.dumps(imp)], ours)) != 0:
                raise AssertionError(f"hybridckpt {' '.join(exp)} failed")
            self._exports[key] = ours
        return self._exports[key]


def records(prefix: str) -> list[tuple[str, dict]]:
    """The records `export_checks/<prefix>*.json`, by name."""
    folder = os.path.join(HERE, "export_checks")
    out = []
    for f in sorted(os.listdir(folder)):
        if f.startswith(prefix) and f.endswith(".json"):
            with open(os.path.join(folder, f)) as fh:
                out.append((f[: -len(".json")], json.load(fh)))
    return out


def stale(name: str, doc: dict, folder: str) -> str | None:
    """Why the record `export_checks/NAME.json` (`doc`) is not about the export in `folder`
    (None when it is: the same digest)."""
    have = (doc.get("export") or {}).get("digest")
    now = digest(folder)
    if have == now:
        return None
    return (
        f"export_checks/{name}.json is stale: the tool's run it records was on an export with digest "
        f"{have}, today's export by the same commands has {now}; rerun the check: {rerun_command(name)}"
    )


def assert_current(name: str, doc: dict, exports: Exports) -> None:
    """The record `name` is about today's export: its commands, run now, give its digest."""
    cmds = (doc.get("export") or {}).get("commands")
    assert cmds, (
        f"export_checks/{name}.json names no export commands; rerun the check: {rerun_command(name)}"
    )
    why = stale(name, doc, exports.make(cmds))
    assert why is None, why


def rerun_command(name: str) -> str:
    """How to write the record `export_checks/NAME.json` again."""
    return f"python tests/real/rerun_export_checks.py {name}"


def flip_tensor_byte(folder: str) -> str:
    """Flip one byte in the middle of the first tensor chunk a DCP export under `folder` stores
    (found through its `.metadata`, read inertly as `digest` reads it); its name returned."""
    for root, _, names in sorted(os.walk(folder)):
        if DCP_METADATA not in names:
            continue
        with open(os.path.join(root, DCP_METADATA), "rb") as f:
            top = _Inert(f.read()).load()
        for index, info in top.state["storage_data"].items():
            if index.state.get("index") is None:  # a byte item
                continue
            path = os.path.join(root, info.state["relative_path"])
            at = info.state["offset"] + info.state["length"] // 2
            with open(path, "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x01]))
            return index.state["fqn"]
    raise ValueError(f"{folder}: no DCP tensor chunk")


# Mutations of the export, for the tests that show a record goes stale: each takes the `run` of
# `Exports` and returns another.


def flip_after(run: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """`run` with one byte of one tensor flipped in what each export wrote."""

    def mutated(argv: list[str]) -> int:
        rc = run(argv)
        if argv[0] == "export" and rc == 0:
            flip_tensor_byte(argv[2])
        return rc

    return mutated


def dropping(option: str) -> Callable[[Callable[[list[str]], int]], Callable[[list[str]], int]]:
    """`run` with the flag `option` left out of each export."""
    return lambda run: (
        lambda argv: run([a for a in argv if a != option] if argv[0] == "export" else argv)
    )
