"""A user's `--rules FILE`: hybridckpt's rules language, or a Paddle AOA config (`rules.aoa`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def load_user_rules(path: str, variables: Mapping[str, Any] | None = None, source=None):
    """A user's `--rules FILE`: hybridckpt's rules language, or a Paddle AOA config (`.aoa`, JSON
    with `aoa_statements`, or text in AOA's syntax) translated by `rules.aoa` against
    `source` (the checkpoint's tensors under the names the rules see)."""
    from hybridckpt.rules import aoa
    from hybridckpt.rules import load_rules as load_text

    if aoa.is_aoa_file(path):
        return aoa.load(path, source=source)
    return load_text(path, variables)
