"""Byte ranges of objects in a bucket: ranged GETs, coalesced, in parallel, bounded, retried.

A data file of a source in object storage is a `RemoteObject` (its URL, its fsspec filesystem,
its listed size). `io.byte_source` sends every read of such a file here instead of to `pread`:

- `plan_ranges(ranges)` (pure): the requests a read makes: ranges sorted, neighbours whose gap is
  at most `COALESCE_GAP_BYTES` merged into one request (a gap is bytes fetched and thrown away;
  64 KiB against a round trip of a request), and each request cut into parts of at most
  `PART_BYTES`, so one large read is many GETs in flight at once.
- `read_ranges(obj, ranges)`: those requests done, through a process-wide cache of the byte
  ranges fetched (`_Fetched`, at most `CACHE_BYTES`, least recently used dropped first): a
  request is split at the ranges already fetched or in flight, and only the holes are asked of
  the server. Devices that split a tensor's columns read runs of every row, which coalesce into
  the same rows for each of them: the first asks for them, the others wait for its answer, so
  each byte crosses the network once however many local devices need it. A read smaller than
  `READAHEAD_BYTES` (a header walked a few bytes at a time: a DCP chunk's `torch.save` zip and
  pickle) fetches that much from its start, so the walk's next reads are already here. Then
  at most `MAX_IN_FLIGHT` GETs in flight in the
  whole process (a semaphore; the parts of one read go through a shared thread pool), each
  retried `TRIES` times with a growing pause on a transient error (a connection refused or
  reset, a timeout, a 5xx), then one CheckpointError naming the URL, the byte range and the
  last error. A missing object or a refused permission is not retried. A GET that returns
  other than the bytes asked for (the object shrank, was replaced) is a FormatError.

`Requests` is what a read cost: GETs and bytes requested per host (`host_of`), which
`io.byte_source` adds to its `count_reads` counters under `(host, "requests")` and
`(host, "requested")`; a planned read (`byte_source.planning`) counts the requests each read
would make on its own (no cache: an upper bound), so `--plan` reports what the import may ask.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hybridckpt.errors import CheckpointError, FormatError, short_repr
from hybridckpt.io.remote.urls import RemoteUrl

COALESCE_GAP_BYTES = 64 << 10  # ranges this close are one request (the gap is fetched, dropped)
PART_BYTES = 16 << 20  # at most this many bytes per GET: a larger read is parts in parallel
MAX_IN_FLIGHT = 16  # GETs in flight at once, the whole process
READAHEAD_BYTES = 64 << 10  # a smaller read fetches this much: the next small reads of a header walk
CACHE_BYTES = 128 << 20  # bytes of fetched ranges kept for the reads of other devices
TRIES = 4  # attempts per GET on a transient error
BACKOFF_S = 0.2  # pause before the second try; doubled each try after

_in_flight = threading.BoundedSemaphore(MAX_IN_FLIGHT)
_totals_lock = threading.Lock()
_totals: dict[str, list[int]] = {}  # host -> [requests, bytes] made by this process (`totals`)
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


@dataclass(frozen=True)
class RemoteObject:
    """One object of a bucket read by ranges. url: its URL (for messages); fs: the fsspec
    filesystem; size: bytes, as listed; host: where its requests go (`host_of`)."""

    url: RemoteUrl
    fs: Any
    size: int
    host: str
    etag: str | None = None  # as listed: a rewrite of the object changes it

    @property
    def key(self) -> str:
        return self.url.path


def host_of(url: RemoteUrl) -> str:
    """The host a URL's requests go to: the S3-compatible endpoint named by `AWS_ENDPOINT_URL`
    (for `s3://`), else `scheme://bucket` (the provider's own host for that bucket)."""
    if url.scheme in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return endpoint.split("://", 1)[-1].rstrip("/")
    return f"{url.scheme}://{url.bucket}"


def add_total(host: str, requests: int, nbytes: int) -> None:
    """Add requests made to `host` to this process's totals (`totals`)."""
    with _totals_lock:
        entry = _totals.setdefault(host, [0, 0])
        entry[0] += requests
        entry[1] += nbytes


def totals() -> dict[str, tuple[int, int]]:
    """Per host, (requests, bytes) this process has asked of it so far: LISTs, metadata GETs and
    ranged GETs (a job's own: the difference of two calls, `since`)."""
    with _totals_lock:
        return {h: (r, b) for h, (r, b) in _totals.items()}


def since(before: dict[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
    """Per host, `{"requests", "bytes"}` asked since `before` (a `totals()`); hosts not asked: absent."""
    out = {}
    for h, (r, b) in totals().items():
        r0, b0 = before.get(h, (0, 0))
        if r > r0:
            out[h] = {"requests": r - r0, "bytes": b - b0}
    return out


def plan_ranges(ranges: Sequence[tuple[int, int]], gap: int | None = None,
                part: int | None = None) -> list[tuple[int, int]]:
    """The GETs (`[start, end)` byte ranges) that fetch every one of `ranges`: sorted, merged
    across gaps of at most `gap` bytes (default `COALESCE_GAP_BYTES`), cut into parts of at most
    `part` bytes (default `PART_BYTES`; both read when called, so a test may scale them). Empty
    ranges ask for nothing."""
    gap = COALESCE_GAP_BYTES if gap is None else gap
    part = PART_BYTES if part is None else part
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[tuple[int, int]] = []
    for start, end in merged:
        out.extend((a, min(a + part, end)) for a in range(start, end, part))
    return out


@dataclass(frozen=True)
class Requests:
    """What a read costs its host: `count` GETs of `nbytes` bytes in all."""

    host: str
    count: int
    nbytes: int


def cost(obj: RemoteObject, gets: Sequence[tuple[int, int]]) -> Requests:
    return Requests(obj.host, len(gets), sum(b - a for a, b in gets))


def wanted(obj: RemoteObject, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges a read of `ranges` asks of the server before the cache: coalesced (no
    parts yet), a read smaller than `READAHEAD_BYTES` widened to that much (to the object's end)."""
    out = plan_ranges(ranges, part=1 << 62)
    if len(out) == 1 and out[0][1] - out[0][0] < READAHEAD_BYTES:  # a header, a small tensor
        out = [(out[0][0], min(out[0][0] + READAHEAD_BYTES, obj.size))]
    return out


def planned_cost(obj: RemoteObject, ranges: Sequence[tuple[int, int]]) -> Requests:
    """What a read of `ranges` costs with nothing fetched before (a planned read: `--plan`): the
    GETs `read_ranges` makes on an empty cache, read-ahead and parts included."""
    return cost(obj, [g for a, b in wanted(obj, ranges) for g in plan_ranges([(a, b)], gap=0)])


def read_ranges(obj: RemoteObject, ranges: Sequence[tuple[int, int]],
                sink: Callable[[int, memoryview], None]) -> Requests:
    """Fetch every byte of `ranges` of `obj` and hand each fetched piece to `sink(start, data)`
    (`data` the object's bytes from `start`; a piece may cover several ranges and the gaps
    between them). Returns what it cost."""
    for start, end in ranges:
        if start < 0 or end > obj.size:
            raise FormatError(f"{obj.url}: read of bytes [{start}, {end}) outside the object's {obj.size} bytes")
    pieces, holes = _FETCHED.claim(obj, wanted(obj, ranges))
    try:
        gets = [g for p in holes for g in plan_ranges([(p.start, p.end)], gap=0)]
        if len(gets) == 1:
            _FETCHED.fill(obj, holes, gets, [get(obj, *gets[0])])
        elif gets:
            _FETCHED.fill(obj, holes, gets, _pool_map(obj, gets))
    except BaseException as e:
        _FETCHED.fail(obj, holes, e)
        raise
    for piece in pieces:
        sink(piece.start, memoryview(piece.result()))
    return cost(obj, gets)


@dataclass(eq=False)
class _Piece:
    """Bytes `[start, end)` of one object: fetched (`data`) or in flight (`done` not set)."""

    start: int
    end: int
    done: threading.Event
    data: bytes | None = None
    error: BaseException | None = None

    def result(self) -> bytes:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.data


class _Fetched:
    """The byte ranges fetched or in flight, per object (see the module doc): at most
    `CACHE_BYTES` of fetched bytes, the least recently used dropped first.

    A piece in flight is filled (or failed) through the piece its fetcher claimed, not found
    again in `pieces`: a `clear` (`forget`, another job's end) may drop it meanwhile, and a
    piece so dropped was never given its bytes: its fetcher, and every reader that had found it
    in flight, waited for it forever (a reader thread lost for good)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pieces: dict[str, list[_Piece]] = {}  # object key -> its pieces (disjoint)
        self.nbytes = 0

    def claim(self, obj: RemoteObject, wanted: list[tuple[int, int]]) -> tuple[list[_Piece], list[_Piece]]:
        """The pieces that cover `wanted` (sorted, disjoint ranges): those held or in flight,
        and new ones in flight for the holes, which the caller fetches (`fill`, or `fail`).
        Returns the pieces overlapping `wanted` and the new ones."""
        out: list[_Piece] = []
        holes: list[tuple[int, int]] = []
        with self.lock:
            held = self.pieces.setdefault(obj.key, [])
            for a, b in wanted:
                at = a
                for p in sorted((p for p in held if p.end > a and p.start < b), key=lambda p: p.start):
                    if p.start > at:
                        holes.append((at, p.start))
                    out.append(p)
                    at = max(at, p.end)
                if at < b:
                    holes.append((at, b))
            new = [_Piece(a, b, threading.Event()) for a, b in holes]
            held.extend(new)
            out.extend(new)
            for p in out:  # used now: the last to be dropped
                held.remove(p)
                held.append(p)
        return out, new

    def fill(self, obj: RemoteObject, new: list[_Piece], gets: list[tuple[int, int]], datas: list[bytes]) -> None:
        """The bytes of the pieces `claim` made (`new`), as fetched by `gets`: into them (kept
        in the cache unless it was cleared meanwhile)."""
        got = dict(zip((a for a, _ in gets), datas, strict=True))
        with self.lock:
            held = self.pieces.get(obj.key, [])
            for p in new:
                parts, at = [], p.start
                while at < p.end:
                    parts.append(got[at])
                    at += len(got[at])
                p.data = b"".join(parts) if len(parts) > 1 else parts[0]
                if any(q is p for q in held):  # (else dropped by `clear`: given to its readers, not kept)
                    self.nbytes += p.end - p.start
                p.done.set()
            self._evict()

    def fail(self, obj: RemoteObject, new: list[_Piece], error: BaseException) -> None:
        """The pieces `claim` made (`new`) could not be fetched: dropped, their waiters given `error`."""
        with self.lock:
            held = self.pieces.get(obj.key, [])
            for p in new:
                p.error = error
                p.done.set()
                if any(q is p for q in held):
                    held.remove(p)

    def _evict(self) -> None:
        """Drop the least recently used fetched pieces past `CACHE_BYTES` (call under `lock`);
        a reader holding one keeps its bytes until it has copied them."""
        while self.nbytes > CACHE_BYTES:
            oldest = next(((k, p) for k, ps in self.pieces.items() for p in ps if p.done.is_set()), None)
            if oldest is None:
                return
            self.pieces[oldest[0]].remove(oldest[1])
            self.nbytes -= oldest[1].end - oldest[1].start

    def clear(self) -> None:
        with self.lock:
            self.pieces.clear()
            self.nbytes = 0


_FETCHED = _Fetched()


def forget() -> None:
    """Drop every fetched range kept (a job's end: the next job reads what the bucket holds then)."""
    _FETCHED.clear()


def _pool_map(obj: RemoteObject, gets: list[tuple[int, int]]) -> list[bytes]:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="hybridckpt-get")
    futures = [_pool.submit(get, obj, a, b) for a, b in gets]
    try:
        return [f.result() for f in futures]
    finally:
        for f in futures:  # an error: the parts not started are not fetched
            f.cancel()


def _permanent(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError | PermissionError | IsADirectoryError)


def get(obj: RemoteObject, start: int, end: int) -> bytes:
    """The bytes `[start, end)` of `obj` by one ranged GET (retried; see the module doc)."""
    last: BaseException | None = None
    for attempt in range(TRIES):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        with _in_flight:
            try:
                data = obj.fs.cat_file(obj.key, start=start, end=end)
            except Exception as e:  # noqa: BLE001 - any client error: transient or named below
                if _permanent(e):
                    raise CheckpointError(f"{obj.url}: cannot read bytes [{start}, {end}): {_brief(e)}") from None
                last = e
                continue
        add_total(obj.host, 1, len(data))
        if len(data) != end - start:
            raise FormatError(
                f"{obj.url}: a read of bytes [{start}, {end}) returned {len(data)} bytes; the object "
                f"changed since it was listed ({obj.size} bytes)"
            )
        return data
    raise CheckpointError(
        f"{obj.url}: reading bytes [{start}, {end}) failed after {TRIES} tries: {_brief(last)}"
    ) from None


def check_unchanged(obj: RemoteObject) -> None:
    """FormatError when `obj` is no longer the object listed (its size or ETag changed): one
    HEAD, made after a job's last read and before its output is committed (`byte_source.watch`)."""
    try:
        info = obj.fs.info(obj.key, refresh=True)
    except Exception as e:  # noqa: BLE001 - the client's error, in one line
        raise CheckpointError(f"{obj.url}: cannot check it is unchanged after reading it: {_brief(e)}") from None
    add_total(obj.host, 1, 0)
    size, etag = info.get("size"), etag_of(info)
    if size != obj.size:
        raise FormatError(f"{obj.url} changed while it was read: size {obj.size} -> {size}")
    if obj.etag is not None and etag != obj.etag:
        raise FormatError(f"{obj.url} changed while it was read: rewritten at the same size {size} "
                          f"(ETag {obj.etag} -> {etag})")


def etag_of(info: dict) -> str | None:
    """The entity tag of an fsspec `info`/listing entry (S3 `ETag`, GCS `etag`), or None."""
    tag = info.get("ETag", info.get("etag"))
    return str(tag) if tag is not None else None


def _brief(e: BaseException | None) -> str:
    """An error in one short line, no credentials: the exception's type and its message cut."""
    if e is None:
        return "no answer"
    text = " ".join(str(e).split()) or "no message"
    return f"{type(e).__name__}: {short_repr(text, 200)[1:-1]}"
