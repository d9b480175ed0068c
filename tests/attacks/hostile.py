"""Hostile and damaged inputs beyond pickles (tests/test_hostile.py): sources whose tensor NAMES,
index entries, tag files, headers and configs are an attacker's, and a world folder to prove that
nothing was written outside the destination.

A `World` is a fresh folder holding `src/` (the hostile source), `dst` (where a job writes) and
`outside/` (where a name tries to make it write); `leftovers()` lists what a job left anywhere in
the world besides the source and the destination, `outside_written()` what appeared in `outside/`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np

# names a checkpoint may hold (as data) that must never become paths; each must round-trip
HOSTILE_NAMES = {
    "absolute": "{outside}/PWNED",
    "dotdot": "../../outside/PWNED",
    "dotdot_inner": "model/../../../outside/x",
    "nul": "model.layers.0\x00.weight",
    "newline": "model.layers.0.weight\n/etc/passwd",
    "dot": ".",
    "dotdot_alone": "..",
    "double_dot": "model..weight",
    "leading_dot": ".hidden.weight",
    "long": "w" * 5000,
    "long_parts": ".".join(["part"] * 60),
    "reserved_prefix": "hcx_0123456789abcdef0123456789abcdef01234567",
    "unicode": "modèle.couche.0.poids",
    "confusable": "model.l\u0430yers.0.weight",  # a Cyrillic a
    "backslash": "model\\..\\..\\x",
    "percent": "model.%2e%2e.x",
    "space": "model layer.weight",
    "empty_part": "model.",
}


@dataclass(frozen=True)
class World:
    root: str

    @property
    def src(self) -> str:
        return os.path.join(self.root, "src")

    @property
    def dst(self) -> str:
        return os.path.join(self.root, "dst")

    @property
    def outside(self) -> str:
        return os.path.join(self.root, "outside")

    def leftovers(self) -> list[str]:
        """Entries of the world other than src/, dst, outside/ (a job's litter)."""
        return sorted(n for n in os.listdir(self.root) if n not in ("src", "dst", "outside", "out"))

    def outside_written(self) -> list[str]:
        return sorted(os.path.join(d, f) for d, _, fs in os.walk(self.outside) for f in fs)


def make_world(root: str) -> World:
    w = World(str(root))
    os.makedirs(w.src, exist_ok=True)
    os.makedirs(w.outside, exist_ok=True)
    return w


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    """A safetensors file from a header dict given as is (hostile values kept) and its data."""
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data


def raw_header_file(path: str, header_text: str, data: bytes = b"") -> None:
    """A safetensors file whose header is `header_text` verbatim (e.g. a 5000-digit number)."""
    blob = header_text.encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def unknown_arch_folder(folder: str, tensors: dict[str, np.ndarray], config: dict | None = None) -> None:
    """An HF folder of an architecture no family implements: tensors keep their own names."""
    from hybridckpt.containers.safetensors_file import write

    os.makedirs(folder, exist_ok=True)
    write(os.path.join(folder, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config or {"architectures": ["HostileForCausalLM"], "model_type": "hostile"}, f)


def tree_digest(root: str) -> dict[str, bytes]:
    """Every file under `root` with its bytes (for small sources: proves one left untouched)."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out
