"""The order the files go out to `-n 2`'s workers (tests/balance.py): longest first, each file's
tests kept together and in order, and xdist told not to reorder them by test count."""

from __future__ import annotations

import os
import tomllib
from types import SimpleNamespace

import balance

TESTS = os.path.dirname(__file__)


def _items(*names: str) -> list:
    return [SimpleNamespace(path=os.path.join(TESTS, n.split("::")[0]), name=n) for n in names]


def test_files_go_longest_first_with_their_tests_in_order(monkeypatch):
    monkeypatch.setattr(balance, "COST", {"jobs/test_slow.py": 100.0, "test_mid.py": 2.0})
    monkeypatch.setattr(balance, "PER_TEST", 0.5)
    items = _items(
        "test_mid.py::a",  # 2 s (listed)
        "test_many.py::a", "test_many.py::b", "test_many.py::c", "test_many.py::d",  # 4 x 0.5 s
        "test_one.py::a",  # 0.5 s: the end
        "jobs/test_slow.py::b", "jobs/test_slow.py::a",  # 100 s: first, b still before a
        "test_many.py::e",  # a file's tests come out together (5 x 0.5 = 2.5 s)
    )
    got = [i.name for i in balance.longest_first(items, TESTS)]
    assert got == [
        "jobs/test_slow.py::b", "jobs/test_slow.py::a",
        "test_many.py::a", "test_many.py::b", "test_many.py::c", "test_many.py::d", "test_many.py::e",
        "test_mid.py::a",
        "test_one.py::a",
    ]


def test_equal_costs_keep_the_collected_order():
    items = _items("b/test_x.py::a", "a/test_y.py::a", "c/test_z.py::a")
    assert [i.name for i in balance.longest_first(items, TESTS)] == [i.name for i in items]


def test_xdist_keeps_the_order_and_every_listed_file_exists():
    # xdist's default reorders the files by test count again, undoing the order above
    with open(os.path.join(TESTS, os.pardir, "pyproject.toml"), "rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert "--dist" in addopts and addopts[addopts.index("--dist") + 1] == "loadfile"
    assert "--no-loadscope-reorder" in addopts
    # a renamed or removed file would keep a figure that orders nothing
    missing = [rel for rel in balance.COST if not os.path.isfile(os.path.join(TESTS, rel))]
    assert not missing, missing
