"""The committed real-tool cases as the tests see them (`tests/real/make.py` wrote them)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases")


def case_dir(case: str) -> str:
    """`tests/real/cases/<case>`; a missing case fails the test (never a skip: the corpus is committed)."""
    path = os.path.join(CASES, case)
    if not os.path.isdir(path):
        pytest.fail(f"real-tool case {case!r} is not in tests/real/cases (python tests/real/make.py ...)")
    return path


def ckpt(case: str, *parts: str) -> str:
    """The checkpoint the tool wrote (`<case>/ckpt/...`)."""
    return os.path.join(case_dir(case), "ckpt", *parts)


def manifest(case: str) -> dict:
    with open(os.path.join(case_dir(case), "manifest.json")) as f:
        return json.load(f)


def reference(case: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(case_dir(case), "reference.safetensors"))


def all_cases() -> list[str]:
    return sorted(d for d in os.listdir(CASES) if os.path.isfile(os.path.join(CASES, d, "manifest.json")))
