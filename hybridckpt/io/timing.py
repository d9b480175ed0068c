"""Where a job's time goes: seconds, bytes and calls per stage and per worker thread.

`with account() as acc: ...; acc.result()` records, while the block runs, every `stage(name)`
block any thread enters (`with stage("write", nbytes): ...`) and every `add_bytes(n)`, and
returns a `Profile` (frozen): per stage its busy seconds summed over threads, its wall-clock
seconds (the time at least one thread was in it), its share of the wall time, bytes and calls;
per worker (thread name, stage) the same busy seconds, bytes and calls.

What is counted where:
- A thread is in one stage at a time: a stage entered inside another (a read inside a stage of
  the caller) pauses the outer one in that thread (exclusive time; the outer resumes after).
- `share_s`: each moment of the account's wall time is split between the stages threads are in
  at that moment, in proportion to how many threads are in each (3 readers and 1 writer: 3/4 of
  that moment is "read"); a moment no thread is in any stage is `other_s` ("other/waiting": the
  main thread waiting, Python between stages, what no stage covers). So the shares and
  `other_s` sum to `wall_s` exactly, whatever overlaps.
- A `fallback` stage (`stage("metadata", fallback=True)`: a caller that waits on workers while it
  also does work of its own, as Orbax's save does) takes only the moments no ordinary stage is
  running: its busy, wall and share seconds are those moments.
- Bytes: `add_bytes(n)` adds to the stage this thread is in (`io.byte_source` adds every byte it
  really reads, so a stage "read" counts the source bytes that arrived in it; the reads of
  "open" are the source's metadata); `stage(name, nbytes)` adds `nbytes` to its own stage.

Cost: with no account open, `stage()` is one global test and returns a shared no-op context,
and `add_bytes` one test (tests/io/test_timing.py and tests/jobs/test_profile.py count that
nothing else runs); with one open, a stage is entered and left under one lock each (a few
counters: microseconds), once per tile, chunk file or write buffer, never per read, and
`add_bytes` (per read) adds to this thread's own stage entry, no lock
(`benchmarks/profile_account.py` measures the overhead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

STAGES = ("launch", "start", "open", "plan", "read", "cut", "checksum", "write", "sync", "metadata", "transfer", "remove")
# launch: a command's process from its start (the kernel's record) until the command called its job:
# Python's start and the CLI's modules (`Profile.in_process`, the `hybridckpt` command only);
# start: modules loaded by a first job (JAX, Orbax); open: the source's indexes and headers;
# plan: names, shardings, tiles; read: source bytes into buffers (with the lazy tensor's casts and
# joins); cut: tiles cut into chunks, pieces of chunks copied out (copies, padding); checksum:
# CRC-32; write: bytes into output files; sync: fsync; metadata: Orbax's own records and commit;
# transfer: to devices; remove: the output an overwrite replaced, deleted once the new one is in place

DRAIN_AT = 64  # events recorded before a thread that finds the lock free applies them (`_Account.switch`)
_accounts: list[_Account] = []
_local = threading.local()  # .stack: the stages this thread is in, innermost last


@dataclass(frozen=True)
class StageTime:
    """One stage of a `Profile`: busy seconds summed over threads, wall-clock seconds at least
    one thread was in it, its share of the wall time (see the module doc), bytes, calls."""

    stage: str
    busy_s: float
    wall_s: float
    share_s: float
    bytes: int
    calls: int

    @property
    def mb_per_s(self) -> float:
        """Bytes per busy second per worker, in MB/s (0 without bytes or time)."""
        return self.bytes / self.busy_s / 1e6 if self.busy_s > 0 and self.bytes else 0.0


@dataclass(frozen=True)
class WorkerTime:
    """One (thread, stage) of a `Profile`: that thread's busy seconds in the stage, its bytes, calls."""

    worker: str
    stage: str
    busy_s: float
    bytes: int
    calls: int


@dataclass(frozen=True)
class Profile:
    """The account of one job: `wall_s` (the account's own wall time), `stages` (those entered,
    in `STAGES` order), `workers` (by thread name), `other_s` (the wall time no stage covered):
    `sum(s.share_s for s in stages) + other_s == wall_s`."""

    wall_s: float
    stages: tuple[StageTime, ...]
    workers: tuple[WorkerTime, ...]
    other_s: float

    def stage(self, name: str) -> StageTime:
        """The stage `name` (zeros when nothing entered it)."""
        return next((s for s in self.stages if s.stage == name), StageTime(name, 0.0, 0.0, 0.0, 0, 0))

    def to_json(self) -> dict:
        """Plain JSON: seconds rounded to microseconds."""
        r = lambda x: round(x, 6)  # noqa: E731
        return {
            "wall_s": r(self.wall_s),
            "other_s": r(self.other_s),
            "stages": [{"stage": s.stage, "busy_s": r(s.busy_s), "wall_s": r(s.wall_s), "share_s": r(s.share_s),
                        "bytes": s.bytes, "calls": s.calls} for s in self.stages],
            "workers": [{"worker": w.worker, "stage": w.stage, "busy_s": r(w.busy_s), "bytes": w.bytes,
                         "calls": w.calls} for w in self.workers],
        }

    def in_process(self, launch_s: float, call_s: float) -> Profile:
        """This account widened to the process that ran its job: a stage "launch" of `launch_s`
        seconds first (the process's start until the job was called: `process_age_s` then), and
        other/waiting grown by the seconds of the job's call outside the account (`call_s`, the
        call's wall, minus `wall_s`: the job's set-up before the account opened, its clean-up after).
        The shares and other/waiting still sum to `wall_s`, now the process's age when the call
        returned."""
        launch_s, outside = max(0.0, float(launch_s)), max(0.0, float(call_s) - self.wall_s)
        launch = StageTime("launch", launch_s, launch_s, launch_s, 0, 1)
        return dataclasses.replace(self, wall_s=self.wall_s + launch_s + outside, other_s=self.other_s + outside,
                                   stages=(launch, *(s for s in self.stages if s.stage != "launch")),
                                   workers=(WorkerTime("MainThread", "launch", launch_s, 0, 1),
                                            *(w for w in self.workers if w.stage != "launch")))

    @classmethod
    def from_json(cls, doc: dict) -> Profile:
        """The `Profile` of `to_json`'s output (a benchmark's child process reports it so)."""
        return cls(float(doc["wall_s"]), tuple(StageTime(**s) for s in doc["stages"]),
                   tuple(WorkerTime(**w) for w in doc["workers"]), float(doc["other_s"]))


class _Account:
    """The accumulator of one `account()` block (see the module doc).

    A stage entered or left is an event (`switch`) appended to `events` without a lock (a deque's
    appends are atomic); the events are applied in the order they were appended, under `lock`,
    by whichever thread finds it free once `DRAIN_AT` are waiting, and by `result`. Before, each
    event took the lock itself: a 4.7 GB restore's 7,000 events on 4 reader threads waited on each
    other for it, 15 us of CPU an event against 3 us alone (2-core VM of docs/benchmarks.md).
    `running` and `fallback` hold only the stages some thread is in (count > 0), `n_running` and
    `n_fallback` their sums: applying an event walks only the stages running (`_advance`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t0 = self.last = time.perf_counter()
        self.running: dict[str, int] = {}  # stage -> threads in it now (ordinary stages; > 0 only)
        self.fallback: dict[str, int] = {}  # fallback stage -> threads in it now (> 0 only)
        self.n_running = 0  # sum(running.values())
        self.n_fallback = 0  # sum(fallback.values())
        self.share: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.other = 0.0
        self.cells: dict[tuple[str, str], list] = {}  # (worker, stage) -> [busy s, bytes, calls]
        self.fallback_cells: dict[tuple[str, str], list] = {}  # the cells of fallback stages
        self.result_: Profile | None = None
        self.events: deque = deque()  # (worker, old, new, now, closed) not yet applied

    def _advance(self, now: float) -> None:
        """Attribute the time since the last event (call under `lock`)."""
        dt = now - self.last
        if dt <= 0:  # (a thread that read the clock before the last event took the lock: no time back)
            return
        self.last = now
        if self.n_running:
            running, total = self.running, self.n_running
        elif self.n_fallback:
            running, total = self.fallback, self.n_fallback
        else:
            self.other += dt
            return
        share, wall = self.share, self.wall
        for s, n in running.items():
            share[s] = share.get(s, 0.0) + dt * n / total
            wall[s] = wall.get(s, 0.0) + dt
        if running is self.fallback:  # the fallback stages' busy time: these moments, per thread in them
            for (_w, s), cell in self.fallback_cells.items():
                if s in running:
                    cell[0] += dt

    def switch(self, worker: str, old: tuple[str, bool] | None, new: tuple[str, bool] | None,
               now: float, closed: tuple[str, float, int, int] | None = None) -> None:
        """A thread left stage `old` for `new` (either None: no stage) at `now`, adding `closed`
        (stage, busy seconds, bytes, calls) to its cell: recorded now, applied in order by the
        thread that next finds the lock free with `DRAIN_AT` events waiting, or by `result`."""
        self.events.append((worker, old, new, now, closed))
        if len(self.events) >= DRAIN_AT and self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()

    def _drain(self) -> None:
        """Apply the events recorded so far, in order (call under `lock`)."""
        take = self.events.popleft
        while self.events:
            worker, old, new, now, closed = take()
            if self.result_ is not None:
                continue
            if closed is not None:
                cell = self.cells.get((worker, closed[0]))
                if cell is None:
                    cell = self.cells[(worker, closed[0])] = [0.0, 0, 0]
                cell[0] += closed[1]
                cell[1] += closed[2]
                cell[2] += closed[3]
            self._advance(now)
            if old is not None:
                self._count(old[0], old[1], -1)
            if new is not None:
                self._count(new[0], new[1], 1)
                if new[1]:
                    self.fallback_cells.setdefault((worker, new[0]), self._cell(worker, new[0]))

    def _count(self, name: str, fallback: bool, delta: int) -> None:
        """One thread more (`delta` 1) or fewer (-1) in stage `name`, never below 0 (a stage
        entered before this account was opened: call under `lock`)."""
        table = self.fallback if fallback else self.running
        n = table.get(name, 0)
        m = max(0, n + delta)
        if m:
            table[name] = m
        elif n:
            del table[name]
        if fallback:
            self.n_fallback += m - n
        else:
            self.n_running += m - n

    def _cell(self, worker: str, stage: str) -> list:
        return self.cells.setdefault((worker, stage), [0.0, 0, 0])

    def add(self, worker: str, stage: str, seconds: float, nbytes: int, calls: int) -> None:
        with self.lock:
            self._drain()  # (the events before it first: its cell as they left it)
            if self.result_ is not None:
                return
            cell = self._cell(worker, stage)
            cell[0] += seconds
            cell[1] += nbytes
            cell[2] += calls

    def result(self) -> Profile:
        with self.lock:
            if self.result_ is None:
                self._drain()
                self._advance(time.perf_counter())
                self.result_ = self._freeze()
            return self.result_

    def _freeze(self) -> Profile:
        order = {s: i for i, s in enumerate(STAGES)}
        names = sorted({s for _, s in self.cells} | set(self.share), key=lambda s: (order.get(s, len(order)), s))
        stages = []
        for s in names:
            cells = [c for (_, st), c in self.cells.items() if st == s]
            stages.append(StageTime(s, sum(c[0] for c in cells), self.wall.get(s, 0.0), self.share.get(s, 0.0),
                                    sum(c[1] for c in cells), sum(c[2] for c in cells)))
        workers = tuple(WorkerTime(w, s, c[0], c[1], c[2])
                        for (w, s), c in sorted(self.cells.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99))))
        return Profile(self.last - self.t0, tuple(stages), workers, self.other)


def accounted(job):
    """Decorator: `job(..., profile=True)` runs inside an `account()` and returns its result (a
    frozen dataclass with a `profile` field) with `profile` set to the `Profile`; without
    `profile` (or False) nothing is recorded and the result is the job's own."""

    @functools.wraps(job)
    def run(*args, profile: bool = False, **kwargs):
        with account(bool(profile)) as acc:
            result = job(*args, **kwargs)
        return result if acc is None else dataclasses.replace(result, profile=acc.result())

    return run


def process_age_s() -> float | None:
    """Seconds since this process started, by the kernel's record (`/proc/self/stat` field 22:
    clock ticks since boot, 10 ms each, against `CLOCK_BOOTTIME`); None without /proc."""
    try:
        with open("/proc/self/stat", "rb") as f:
            text = f.read()
        ticks = int(text[text.rindex(b")") + 2:].split()[19])  # (after the command name, which may hold spaces)
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def enabled() -> bool:
    """Whether an account is open (anything recorded at all)."""
    return bool(_accounts)


@contextlib.contextmanager
def account(on: bool = True) -> Iterator[_Account | None]:
    """Record every stage entered while the block runs (any thread); yields the accumulator
    (`.result()`: the `Profile`, final once taken), or None with `on=False` (nothing recorded)."""
    if not on:
        yield None
        return
    acc = _Account()
    _accounts.append(acc)
    try:
        yield acc
    finally:
        acc.result()
        _accounts.remove(acc)


class _Stage:
    """The context manager of one `stage()` while an account is open."""

    __slots__ = ("name", "nbytes", "fallback", "t0", "accounts")

    def __init__(self, name: str, nbytes: int, fallback: bool):
        self.name, self.nbytes, self.fallback = name, nbytes, fallback

    def __enter__(self) -> _Stage:
        stack = _stack()
        now = time.perf_counter()
        self.accounts = list(_accounts)
        worker = threading.current_thread().name
        old = stack[-1] if stack else None
        closed = None if old is None else _close(old, now)  # the outer stage pauses in this thread
        stack.append([self.name, self.fallback, now, 0])
        for acc in self.accounts:
            acc.switch(worker, None if old is None else (old[0], old[1]), (self.name, self.fallback), now, closed)
        return self

    def __exit__(self, kind, value, tb) -> None:
        stack = _stack()
        now = time.perf_counter()
        worker = threading.current_thread().name
        top = stack.pop()
        if kind is None:  # (a write that failed moved no bytes)
            top[3] += self.nbytes
        closed = _close(top, now, calls=1)
        outer = stack[-1] if stack else None
        if outer is not None:
            outer[2] = now  # resumes
        for acc in self.accounts:
            acc.switch(worker, (self.name, self.fallback), None if outer is None else (outer[0], outer[1]), now,
                       closed)


def _close(entry: list, now: float, calls: int = 0) -> tuple[str, float, int, int]:
    """(stage, seconds, bytes, calls) of `entry` since it (re)started, its bytes taken (fallback
    stages' seconds come from the account's own attribution)."""
    name, fallback, since, nbytes = entry
    entry[3] = 0
    return name, 0.0 if fallback else now - since, nbytes, calls


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


_NULL = contextlib.nullcontext()


def stage(name: str, nbytes: int = 0, *, fallback: bool = False):
    """A context manager timing its block as stage `name` of this thread, adding `nbytes`
    (see the module doc); a shared no-op when no account is open."""
    if not _accounts:
        return _NULL
    return _Stage(name, int(nbytes), fallback)


def add_bytes(nbytes: int, default: str = "read") -> None:
    """Add `nbytes` to the stage this thread is in (`default` when none): no-op with no account."""
    if not _accounts:
        return
    stack = _stack()
    if stack:
        stack[-1][3] += int(nbytes)
    else:
        worker = threading.current_thread().name
        for acc in list(_accounts):
            acc.add(worker, default, 0.0, int(nbytes), 0)
