"""`io.open_files.held`: a file's first open runs outside the module's lock, so reader threads
opening different files do not wait on each other's `open` and `fstat` (issue 42: the lock was 4%
of a restore's reader samples); two threads that open the same path at once end with one kept
descriptor, the other closed. At most `keep_open()` descriptors stay open, the least recently
read closed first, never one a read holds; a watched job's check still sees a file changed after
its descriptor was closed. Counted, not timed."""

from __future__ import annotations

import os
import threading

import pytest

from hybridckpt.io import open_files


def _fd(path: str) -> int:
    with open_files.held(path) as fd:
        return fd


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
        with open_files.held(path) as fd:
            pass
        with open_files.held(path) as again:
            assert again == fd  # kept: opened once
        assert held == [False]
        with open_files.watch() as w, open_files.held(path) as again:  # a watched job's first read records the file
            assert again == fd
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
            t = threading.Thread(target=lambda: out.setdefault("first", _fd(path)))
            t.start()
            assert first_inside.wait(5)
            out["second"] = _fd(path)
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


def test_at_most_keep_open_descriptors_stay_open_and_a_held_one_is_never_closed(tmp_path, monkeypatch):
    """Past `keep_open()` an open closes the least recently read descriptors no read holds:
    20 files read through 4 kept descriptors, every byte right; a file held meanwhile keeps its
    descriptor (open, and the same file) whatever is opened after it. (Before, every file stayed
    open: a restore of more chunk files than the soft RLIMIT_NOFILE failed.)"""
    from hybridckpt.io.byte_source import ByteSource

    monkeypatch.setattr(open_files, "_kept", [4])
    paths = []
    for i in range(20):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * 8192)
        paths.append(str(p))
    try:
        with open_files.held(paths[0]) as kept:
            for i, p in enumerate(paths[1:], 1):
                assert ByteSource(p).read(100, 10) == bytes([i]) * 10
                assert len(open_files._fds) <= 4
            assert open_files._fds[paths[0]] == kept  # held: not closed, not replaced
            assert os.fstat(kept).st_ino == os.stat(paths[0]).st_ino
            assert os.pread(kept, 4, 0) == bytes([0]) * 4
        for i, p in enumerate(paths):  # read again: reopened as needed
            assert ByteSource(p).read(0, 3) == bytes([i]) * 3
        assert len(open_files._fds) <= 4
    finally:
        open_files.close_all()


def test_a_watched_file_changed_after_its_descriptor_was_closed_is_caught(tmp_path, monkeypatch):
    """A watched job's check covers the files whose descriptors were closed since their first
    read (`keep_open`): by the file the path names now."""
    from hybridckpt.errors import FormatError
    from hybridckpt.io.byte_source import ByteSource

    monkeypatch.setattr(open_files, "_kept", [2])
    paths = [_fresh(tmp_path, n) for n in "abcd"]
    try:
        with open_files.watch() as w:
            for p in paths:
                ByteSource(p).read(0, 4)
            assert paths[0] not in open_files._fds and paths[0] in w.seen  # closed, still watched
            w.check()  # nothing changed
            with open(paths[0], "ab") as f:
                f.write(b"more")
            with pytest.raises(FormatError, match="/a changed while it was read: size"):
                w.check()
            with open(paths[0], "rb+") as f:  # (back as it was read: size and mtime)
                f.truncate(4096)
            os.utime(paths[0], ns=(w.seen[paths[0]].mtime_ns,) * 2)
            w.check()
            os.remove(paths[1])  # (closed too: gone since its first read)
            with pytest.raises(FormatError, match="/b changed while it was read"):
                w.check()
    finally:
        open_files.close_all()
