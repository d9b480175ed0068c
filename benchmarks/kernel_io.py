"""The kernel's count of a process's reads, to cross-check the library's own (`count_reads`).

`/proc/self/io` (Linux): `read_bytes` is what the process caused to be fetched from the storage
layer (page faults on mapped files included, readahead included, pages found in the page cache
not); `rchar` what its `read`/`pread` calls returned (mapped reads not included). So the check
runs on a cold cache: `drop_cache` writes back and then drops every page of the source files
(`posix_fadvise(DONTNEED)`, no root needed); each reading process notes `proc_io()` before and
after its job, and `cross_check` compares `read_bytes` with the library's count. Where dropping
did not take (`read_bytes` near zero: a filesystem with no backing store, or no fadvise), `rchar`
is the kernel's figure instead, and the check says so.
"""

from __future__ import annotations

import os
import subprocess

TOLERANCE = 0.10  # |kernel / library - 1| allowed: readahead past a read's end, shared pages
COLD_MIN = 0.01  # read_bytes under this fraction of the library's count: the cache was not dropped


def proc_io() -> dict[str, int]:
    """This process's `/proc/self/io` counters (bytes); {} where there is none."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except (OSError, ValueError):
        return {}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("read_bytes", "rchar") if k in before and k in after}


def drop_cache(paths: list[str]) -> str:
    """Write back, then drop the page cache of `paths`; "" or why it could not be asked."""
    subprocess.run(["sync"], check=True)
    if not hasattr(os, "posix_fadvise"):
        return "no posix_fadvise on this platform"
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ""


def cross_check(library: int, kernel: dict[str, int], note: str = "") -> dict:
    """The kernel's figure beside the library's: {"kernel", "source" ("read_bytes, cold cache" or
    "rchar, ..."), "ratio", "ok", "why"}; `ok` False beyond TOLERANCE."""
    rb, rc = kernel.get("read_bytes"), kernel.get("rchar")
    if rb is not None and not note and rb >= COLD_MIN * max(library, 1):
        figure, source = rb, "read_bytes, cold cache"
    elif rc is not None:
        figure = rc
        why = note or f"read_bytes {rb} B: the page cache was not dropped"
        source = f"rchar ({why}; mapped reads not counted)"
    else:
        return {"kernel": None, "source": "no /proc/self/io", "ratio": None, "ok": False, "why": "not checked"}
    ratio = figure / library if library else float("inf")
    ok = abs(ratio - 1) <= TOLERANCE
    why = "" if ok else f"kernel {figure} B vs library {library} B: {ratio:.3f}x, beyond +-{TOLERANCE:.0%}"
    return {"kernel": figure, "source": source, "ratio": ratio, "ok": ok, "why": why}
