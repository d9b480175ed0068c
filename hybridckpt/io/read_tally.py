"""What a `byte_source.count_reads` counter holds, summed: bytes, calls, runs, gaps, requests.

A counter's keys are a path (bytes read from it) or `(path, kind)` with kind "calls", "runs",
"gap" (gap bytes read between joined runs), "direct" (bytes of them read with O_DIRECT,
`io.direct_read`), and for sources in object storage `(host,
"requests")` / `(host, "requested")` (ranged GETs and the bytes they asked for). Pure functions.
"""

from __future__ import annotations

from collections import Counter


def runs_of(counter: Counter) -> int:
    """The contiguous file runs a `count_reads` counter's reads fetched (at most its calls: a
    span or a batch of runs is one call, `read_span`, `ByteSource.read_runs`)."""
    return sum(v for k, v in counter.items() if isinstance(k, tuple) and k[1] == "runs")


def tally(counter: Counter) -> tuple[int, int, int, set[str]]:
    """(bytes, calls, gap bytes, paths) of a `count_reads` counter."""
    nbytes = calls = gaps = 0
    paths: set[str] = set()
    for k, v in counter.items():
        if isinstance(k, tuple):
            if k[1] == "calls":
                calls += v
                paths.add(k[0])
            elif k[1] == "gap":
                gaps += v
        else:
            nbytes += v
    return nbytes, calls, gaps, paths


def remote_requests(counter: Counter) -> dict[str, dict[str, int]]:
    """Per host, the `{"requests", "bytes"}` a `count_reads` counter recorded for sources in
    object storage (empty for local sources)."""
    out: dict[str, dict[str, int]] = {}
    for k, v in counter.items():
        if isinstance(k, tuple) and k[1] in ("requests", "requested"):
            entry = out.setdefault(k[0], {"requests": 0, "bytes": 0})
            entry["requests" if k[1] == "requests" else "bytes"] += v
    return out
