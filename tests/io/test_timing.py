"""`io.timing`: the account of a job's time, checked on a fake clock (exact seconds, no timing):
shares of the wall time split between the threads' stages and summing to it, exclusive time of
nested stages, fallback stages, bytes per stage, and nothing recorded when no account is open."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from hybridckpt.io import timing


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


class Worker:
    """A thread that enters and leaves stages when told (so two threads' stages overlap at
    moments the test chooses on the fake clock)."""

    def __init__(self, name: str):
        self.todo: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name)
        self.thread.start()

    def _loop(self) -> None:
        held = []
        while (cmd := self.todo.get()) is not None:
            if cmd[0] == "enter":
                held.append(timing.stage(*cmd[1:]))
                held[-1].__enter__()
            elif cmd[0] == "bytes":
                timing.add_bytes(cmd[1])
            else:
                held.pop().__exit__(None, None, None)
            self.done.put(True)

    def do(self, *cmd) -> None:
        self.todo.put(cmd)
        self.done.get(timeout=30)

    def stop(self) -> None:
        self.todo.put(None)
        self.thread.join()


def test_shares_split_overlapping_stages_and_sum_to_the_wall_time(clock):
    a, b = Worker("reader"), Worker("writer")
    try:
        with timing.account() as acc:  # t = 0
            clock[0] = 1.0
            with timing.stage("metadata", fallback=True):  # waits on the workers, works between them
                clock[0] = 2.0
                a.do("enter", "read")
                a.do("bytes", 300)
                clock[0] = 3.0
                b.do("enter", "write", 100)
                clock[0] = 5.0
                a.do("exit")
                clock[0] = 6.0
                b.do("exit")
                clock[0] = 8.0
            clock[0] = 10.0
        p = acc.result()
    finally:
        a.stop()
        b.stop()
    # 0-1 nothing, 1-2 metadata alone, 2-3 read, 3-5 read and write (half each), 5-6 write,
    # 6-8 metadata alone, 8-10 nothing
    assert p.wall_s == 10.0
    assert p.other_s == 3.0
    assert {s.stage: (s.share_s, s.wall_s, s.busy_s, s.bytes, s.calls) for s in p.stages} == {
        "read": (2.0, 3.0, 3.0, 300, 1),
        "write": (2.0, 3.0, 3.0, 100, 1),
        "metadata": (3.0, 3.0, 3.0, 0, 1),
    }
    assert [s.stage for s in p.stages] == ["read", "write", "metadata"]  # in `STAGES` order
    assert sum(s.share_s for s in p.stages) + p.other_s == p.wall_s
    assert {(w.worker, w.stage, w.busy_s, w.bytes) for w in p.workers} == {
        ("reader", "read", 3.0, 300), ("writer", "write", 3.0, 100), ("MainThread", "metadata", 3.0, 0)}
    assert p.stage("sync") == timing.StageTime("sync", 0.0, 0.0, 0.0, 0, 0)


def test_threads_in_one_stage_share_by_count(clock):
    a, b = Worker("w0"), Worker("w1")
    try:
        with timing.account() as acc:
            a.do("enter", "read")
            b.do("enter", "read")
            clock[0] = 4.0
            with timing.stage("write"):  # 3 threads: read holds 2/3 of these 2 s
                clock[0] = 6.0
            a.do("exit")
            b.do("exit")
        p = acc.result()
    finally:
        a.stop()
        b.stop()
    read, write = p.stage("read"), p.stage("write")
    assert (read.busy_s, read.wall_s) == (12.0, 6.0)
    assert read.share_s == pytest.approx(4.0 + 4.0 / 3)
    assert write.share_s == pytest.approx(2.0 / 3)
    assert read.share_s + write.share_s + p.other_s == pytest.approx(p.wall_s)


def test_a_nested_stage_pauses_the_outer_one_and_takes_its_bytes(clock):
    with timing.account() as acc:
        clock[0] = 1.0
        with timing.stage("read", 10):
            timing.add_bytes(5)
            clock[0] = 2.0
            with timing.stage("checksum", 7):
                timing.add_bytes(1)
                clock[0] = 4.0
            timing.add_bytes(2)
            clock[0] = 5.0
        timing.add_bytes(100)  # outside any stage: counted as read, no time
        clock[0] = 6.0
    p = acc.result()
    assert {s.stage: (s.busy_s, s.share_s, s.bytes, s.calls) for s in p.stages} == {
        "read": (2.0, 2.0, 117, 1), "checksum": (2.0, 2.0, 8, 1)}
    assert p.other_s == 2.0
    assert p.to_json()["stages"][0] == {"stage": "read", "busy_s": 2.0, "wall_s": 2.0, "share_s": 2.0,
                                        "bytes": 117, "calls": 1}


def test_nothing_is_recorded_without_an_account(monkeypatch):
    calls = []
    for name in ("switch", "add", "result"):
        original = getattr(timing._Account, name)
        monkeypatch.setattr(timing._Account, name,
                            lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k))
    assert not timing.enabled()
    assert timing.stage("read", 5) is timing._NULL  # the shared no-op
    with timing.stage("read", 5):
        timing.add_bytes(5)
    with timing.account(on=False) as acc:
        assert acc is None
        with timing.stage("write"):
            pass
    assert calls == []
    with timing.account() as acc:  # (the patch counts: on, it is called)
        with timing.stage("write"):
            pass
    assert calls == ["switch", "switch", "result"]


def test_accounted_sets_the_profile_field_only_when_asked():
    from dataclasses import dataclass
    from typing import Any

    @dataclass(frozen=True)
    class Summary:
        n: int
        profile: Any = None

    @timing.accounted
    def job(n):
        with timing.stage("write", n):
            return Summary(n)

    assert job(3) == Summary(3)
    p = job(3, profile=True).profile
    assert isinstance(p, timing.Profile) and p.stage("write").bytes == 3 and p.stage("write").calls == 1
    assert not timing.enabled()  # the account is closed after the job


def test_a_failed_stage_moves_no_bytes_and_a_stage_older_than_the_account_counts_nothing(clock):
    outer = timing.account()
    outer.__enter__()
    early = timing.stage("read", 50)
    early.__enter__()  # entered under another account, left inside the next one
    with timing.account() as acc:
        clock[0] = 1.0
        early.__exit__(None, None, None)
        with pytest.raises(OSError), timing.stage("write", 100):
            clock[0] = 2.0
            raise OSError("disk full")
        clock[0] = 3.0
    outer.__exit__(None, None, None)
    p = acc.result()
    assert p.stage("write").bytes == 0 and p.stage("write").busy_s == 1.0
    assert p.stage("read").share_s == 0.0  # never seen entering: no time shared to it, no count below 0
    assert sum(s.share_s for s in p.stages) + p.other_s == p.wall_s == 3.0


def test_a_clock_read_before_the_last_event_gives_no_time_twice(clock):
    with timing.account() as acc:
        clock[0] = 5.0
        with timing.stage("write"):
            # another thread read the clock at 3 s, then waited for the lock this thread took at 5 s
            acc.switch("late", None, ("read", False), 3.0)
            clock[0] = 6.0
        acc.switch("late", ("read", False), None, 7.0)
        clock[0] = 8.0
    p = acc.result()
    assert sum(s.share_s for s in p.stages) + p.other_s == p.wall_s == 8.0
    assert (p.stage("write").share_s, p.stage("read").share_s, p.other_s) == (0.5, 1.5, 6.0)


def test_many_threads_switching_at_once_lose_no_event():
    """Stage switches are recorded without a lock and applied in order by whichever thread finds it
    free (`_Account.switch`): 8 threads x 500 stages entered and left at once (more than
    `DRAIN_AT` waiting, the lock taken by others) all counted, bytes summed, and the shares and
    other/waiting still the wall time; nothing left unapplied once the result is taken."""
    threads, rounds = 8, 500
    start = threading.Barrier(threads)

    def work():
        start.wait()
        for _ in range(rounds):
            with timing.stage("read", 3):
                with timing.stage("checksum", 1):
                    pass

    with timing.account() as acc:
        pool = [threading.Thread(target=work, name=f"w{i}") for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    p = acc.result()
    assert not acc.events
    assert (p.stage("read").calls, p.stage("read").bytes) == (threads * rounds, 3 * threads * rounds)
    assert (p.stage("checksum").calls, p.stage("checksum").bytes) == (threads * rounds, threads * rounds)
    assert {w.worker for w in p.workers} == {f"w{i}" for i in range(threads)}
    assert sum(s.share_s for s in p.stages) + p.other_s == pytest.approx(p.wall_s)
