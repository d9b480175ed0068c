"""What every generator shares (runs inside a side venv: numpy and safetensors only, no hybridckpt).

A case folder `tests/real/cases/<case>/`:
- `ckpt/`                  the files the tool wrote, as it wrote them (trimmed of nothing);
- `reference.safetensors`  values taken from the tool's runtime, numpy arrays by key (see the
                           manifest's `references` for what each key is);
- `manifest.json`          `record_manifest`: the tool and its versions, Python, the platform, the
                           command that wrote the case, what each reference is, notes (shims used,
                           what could not be run).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from importlib import metadata

import numpy as np


def fresh_case(out: str, case: str) -> str:
    """An empty `out/<case>/` (a previous copy removed), returned."""
    path = os.path.join(out, case)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def versions(*dists: str) -> dict[str, str]:
    """Installed versions of the named distributions (missing ones say so)."""
    out = {}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = "not installed"
    return out


def write_reference(case_dir: str, arrays: dict[str, np.ndarray]) -> None:
    """`reference.safetensors`: each value as a C-contiguous numpy array (bf16 as float32)."""
    from safetensors.numpy import save_file

    clean = {}
    for k, v in arrays.items():
        a = np.asarray(v)
        if a.dtype.kind == "V" or a.dtype.name == "bfloat16":
            a = a.astype(np.float32)
        clean[k] = np.ascontiguousarray(a)
    save_file(clean, os.path.join(case_dir, "reference.safetensors"))


def record_manifest(case_dir: str, *, tool: str, dists: list[str], command: str, references: dict[str, str],
                    notes: list[str] | None = None, **extra) -> None:
    """`manifest.json` of a case (see the module doc)."""
    doc = {
        "case": os.path.basename(case_dir.rstrip("/")),
        "tool": tool,
        "versions": versions(*dists),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "command": command,
        "references": references,
        "notes": notes or [],
        **extra,
    }
    with open(os.path.join(case_dir, "manifest.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
