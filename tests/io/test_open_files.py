"""`io.open_files.fd`: a file's first open runs outside the module's lock, so reader threads
opening different files do not wait on each other's `open` and `fstat` (issue 42: the lock was 4%
of a restore's reader samples); two threads that open the same path at once end with one cached
descriptor, the other closed. Counted, not timed."""

from __future__ import annotations

import os
import threading

from hybridckpt.io import open_files


def _fresh(tmp_path, name: str) -> str:
    p = tmp_path / name
    p.write_bytes(b"x" * 4096)
    return str(p)


def test_the_first_open_runs_outside_the_lock(tmp_path, monkeypatch):
    path = _fresh(tmp_path, "a")
    held = []
    real = open_files.open_regular_stat

    def spy(p):
        held.append(open_files._lock.locked())
        return real(p)

    monkeypatch.setattr(open_files, "open_regular_stat", spy)
    try:
        fd = open_files.fd(path)
        assert open_files.fd(path) == fd  # cached: opened once
        assert held == [False]
        with open_files.watch() as w:  # a watched job's first read records the file as it is
            assert open_files.fd(path) == fd
            assert path in w.seen
    finally:
        open_files.close_all()


def test_two_threads_opening_one_path_keep_one_descriptor(tmp_path, monkeypatch):
    path = _fresh(tmp_path, "b")
    real = open_files.open_regular_stat
    first_inside, second_done = threading.Event(), threading.Event()
    opened: list[int] = []

    def slow_open(p):  # the first caller opens, then waits until the second has cached the path
        got = real(p)
        opened.append(got[0])
        if len(opened) == 1:
            first_inside.set()
            second_done.wait(5)
        return got

    monkeypatch.setattr(open_files, "open_regular_stat", slow_open)
    out = {}
    try:
        with open_files.watch() as w:
            t = threading.Thread(target=lambda: out.setdefault("first", open_files.fd(path)))
            t.start()
            assert first_inside.wait(5)
            out["second"] = open_files.fd(path)
            second_done.set()
            t.join(5)
            assert out["first"] == out["second"] == open_files._fds[path] == opened[1]
            assert path in w.seen
        try:  # the descriptor the first thread opened was closed, not leaked
            os.fstat(opened[0])
            leaked = opened[0] != opened[1]
        except OSError:
            leaked = False
        assert not leaked
    finally:
        open_files.close_all()
