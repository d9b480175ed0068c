"""The corpus itself: within its budget, and every case says which tool wrote it and how."""

from __future__ import annotations

import os

from cases import CASES, all_cases, manifest

BUDGET_BYTES = 40 << 19  # 20 MiB, the whole committed corpus (tests/real/README.md): 16 MiB until the MaxText cases, 18 MiB until maxtext_gpt_oss, 18.5 MiB until the Megatron GLM-4.5 and Llama 4 cases


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_corpus_within_budget():
    assert _size(CASES) <= BUDGET_BYTES


def test_every_case_names_its_tool_versions_and_command():
    for case in all_cases():
        m = manifest(case)
        assert m["tool"] and m["command"] and m["versions"], case
        assert all(v != "not installed" for v in m["versions"].values()), (case, m["versions"])
        assert os.path.isdir(os.path.join(CASES, case, "ckpt")), case
