"""The rules files the format readers ship (`hybridckpt/formats/rules/<name>.rules`).

Each file is rules text (`hybridckpt.rules`): how one format's names map to HF names, or how one
format's tensor-parallel shards merge. They are package data (pyproject ships
`formats/rules/*.rules`), read through `importlib.resources` so an installed wheel finds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import Any

from hybridckpt.rules import RuleSet, parse_rules


def rules_text(name: str) -> str:
    """The text of `hybridckpt/formats/rules/<name>`."""
    return resources.files("hybridckpt.formats").joinpath("rules", name).read_text(encoding="utf-8")


def load_rules(name: str, variables: Mapping[str, Any] | None = None) -> RuleSet:
    """`rules/<name>` parsed with `variables` (errors name the file)."""
    return parse_rules(rules_text(name), dict(variables or {}), origin=name)
