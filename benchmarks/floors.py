"""The disk's floors a benchmark row is read against, measured in the same run as the row.

- write floor: `nbytes` of the source files copied file to file into fresh files
  (`copy_file_range`, the kernel's copy: no user-space buffer, nothing computed) and each
  fsync'd: what any tool that writes those bytes durably pays at least;
- read floor: `cat` of every source file to /dev/null, page cache warm (the benchmarks read
  warm sources too): what reading them costs at least.

Both are the best of `repeat` runs; `measure` returns `{"write_s", "read_s", "write_bytes",
"read_bytes"}` and `cell(seconds, floor_s)` the table cell: the floor and our multiple of it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time


def write_floor(paths: list[str], out_dir: str, nbytes: int | None = None) -> float:
    """Seconds to copy the first `nbytes` (default: all) bytes of `paths`, file after file, into
    fresh files under `out_dir` and fsync each; `out_dir` is removed afterwards."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    left = sum(os.path.getsize(p) for p in paths) if nbytes is None else int(nbytes)
    subprocess.run(["sync"], check=True)  # no earlier writeback in the way
    t0 = time.perf_counter()
    for i, p in enumerate(paths):
        n = min(left, os.path.getsize(p))
        if n <= 0:
            break
        with open(p, "rb") as src, open(os.path.join(out_dir, f"{i}-{os.path.basename(p)}"), "wb") as dst:
            done = 0
            while done < n:
                got = os.copy_file_range(src.fileno(), dst.fileno(), n - done)
                if got == 0:
                    break
                done += got
            os.fsync(dst.fileno())
        left -= n
    dt = time.perf_counter() - t0
    shutil.rmtree(out_dir, ignore_errors=True)
    return dt


def read_floor(paths: list[str]) -> float:
    """Seconds `cat` takes to read `paths` to /dev/null."""
    t0 = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def files_under(root: str) -> list[str]:
    if os.path.isfile(root):
        return [root]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def measure(paths: list[str], scratch: str, *, write_bytes: int | None = None, repeat: int = 2) -> dict:
    """Both floors of `paths` (see the module doc); `write_bytes`: how many bytes the job writes
    (default: the files' size)."""
    total = sum(os.path.getsize(p) for p in paths)
    wb = total if write_bytes is None else int(write_bytes)
    read_floor(paths)  # warm, as the jobs find them
    return {
        "write_s": min(write_floor(paths, scratch, wb) for _ in range(repeat)),
        "read_s": min(read_floor(paths) for _ in range(repeat)),
        "write_bytes": wb,
        "read_bytes": total,
    }


def cell(seconds: float | None, floor_s: float | None) -> str:
    """`0.45 s (3.9x)`: the floor and how many floors `seconds` is; "-" without a floor."""
    if floor_s is None:
        return "-"
    if seconds is None:
        return f"{floor_s:.2f} s"
    return f"{floor_s:.2f} s ({seconds / floor_s:.1f}x)"


def cached_bytecode(base: str) -> None:
    """Run every child process of this benchmark with Python's bytecode cache, as after a `pip
    install` (which compiles every module): where `PYTHONDONTWRITEBYTECODE` is set (this project's
    sandbox sets it) each child would otherwise compile hybridckpt's modules from source inside
    its timed import (about 0.1 s of a 1 s import). The cache goes under `base`
    (`PYTHONPYCACHEPREFIX`), not into the source tree, and is filled once here, before any timing."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(os.path.abspath(base), "pycache")
    roots = []
    for name in ("hybridckpt", "models"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(spec.submodule_search_locations)
    subprocess.run([sys.executable, "-m", "compileall", "-q", *roots], check=True, stdout=subprocess.DEVNULL)
