"""The disk's floors a benchmark row is read against, measured in the same run as the row.

- write floor, buffered: `nbytes` of the source files copied file to file into fresh files
  (`copy_file_range`, the kernel's copy through the page cache: no user-space buffer, nothing
  computed) and each fsync'd: what any tool that writes those bytes durably through the page
  cache pays at least;
- write floor, O_DIRECT (`direct_write_floor`): the same bytes into files of the same sizes, each
  file read (`preadv`, page cache warm) into 4 KiB-aligned 8 MiB buffers and written from
  them with `O_DIRECT`, the last partial 4 KiB block through the page cache, each file fsync'd:
  how our jobs write (`containers.orbax.chunk_files`, `io.sequential_file`), and on this VM the harder
  floor (the buffered copy pays the kernel's copy into fresh page-cache pages). Where the
  filesystem refuses `O_DIRECT` it is None with the reason (`direct_note`). Since the
  nineteenth stop it is the faster of that way and a queued one (`queued_direct_write_floor`:
  4 threads writing 8 MiB files cut from the sources, one syncfs), which the HF import had
  beaten (0.97x the one-thread way: its writers keep the disk's queue full); since the
  twentieth, the queued way also with 16 MiB files (`QUEUED_PIECES`: 4% faster in a sweep,
  each size the faster in half the rounds of the benchmark runs after it);
- read floor: `cat` of every source file to /dev/null, page cache warm (the benchmarks read
  warm sources too): what reading them costs at least.

Each is the best of `repeat` runs (a floor is what the disk did at its fastest; the rows' own
figures are medians); `measure` returns `{"write_s", "write_direct_s", "write_direct_serial_s",
"write_direct_queued_s", "write_direct_queued_by_mib", "direct_note", "read_s", "write_bytes",
"read_bytes"}`; `cell(seconds, floor_s)` is a table cell (the floor and our multiple
of it) and `write_cell(seconds, floors)` the write floor's cell with both floors.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
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


def direct_write_floor(paths: list[str], out_dir: str, nbytes: int | None = None) -> tuple[float | None, str]:
    """(seconds, note) to write the first `nbytes` (default: all) bytes of `paths` into files of
    the same sizes under `out_dir` with O_DIRECT (module doc), each fsync'd; (None, why) where the
    filesystem refuses O_DIRECT. `out_dir` is removed afterwards."""
    from hybridckpt.io import direct_io

    align, block = direct_io.DIRECT_ALIGN, 8 << 20
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    left = sum(os.path.getsize(p) for p in paths) if nbytes is None else int(nbytes)
    bufs = [direct_io.aligned_empty((block,), "uint8") for _ in range(2)]
    subprocess.run(["sync"], check=True)
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(paths):
            n = min(left, os.path.getsize(p))
            if n <= 0:
                break
            dst = os.path.join(out_dir, f"{i}-{os.path.basename(p)}")
            fd = direct_io.open_direct(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            if fd is None:
                return None, f"{out_dir}: the filesystem refused O_DIRECT at open (EINVAL)"
            src = os.open(p, os.O_RDONLY)
            try:
                done = k = 0
                whole = n - n % align
                while done < whole:
                    buf = bufs[k % 2]
                    want = min(block, whole - done)
                    got = os.preadv(src, [memoryview(buf)[:want]], done)
                    if got != want:
                        raise OSError(f"{p}: short read at {done}")
                    try:
                        os.pwrite(fd, memoryview(buf)[:want], done)
                    except OSError as e:
                        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                            return None, f"{out_dir}: the filesystem refused an O_DIRECT write ({e.strerror})"
                        raise
                    done += want
                    k += 1
                if n > whole:  # the last partial block, through the page cache, as our jobs do
                    with open(dst, "r+b") as tail:
                        tail.seek(whole)
                        tail.write(os.pread(src, n - whole, whole))
                        tail.flush()
                        os.fsync(tail.fileno())
                os.fsync(fd)
            finally:
                os.close(src)
                os.close(fd)
            left -= n
        return time.perf_counter() - t0, "O_DIRECT"
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def queued_direct_write_floor(paths: list[str], out_dir: str, nbytes: int | None = None, threads: int = 4,
                              piece: int = 8 << 20) -> tuple[float | None, str]:
    """(seconds, note) to write the first `nbytes` (default: all) bytes of `paths` with O_DIRECT
    from `threads` threads, so that the disk always has writes queued, as an import's writers
    keep it: each source file cut into files of `piece` bytes (`i-k-name` under `out_dir`; an
    import writes a chunk file each ~5 MB), each thread reading the next into its own 4 KiB-aligned
    buffer (page cache warm) and writing it (the last partial 4 KiB block through the page cache),
    then one `syncfs` of the filesystem (`io.writeback.FilesystemSync`, as an import syncs an
    item; an fsync a file where it cannot) and the folder fsync'd: the same durability. (None,
    why) where the filesystem refuses O_DIRECT. `out_dir` is removed afterwards."""
    from hybridckpt.io import direct_io, writeback

    align = direct_io.DIRECT_ALIGN
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    left = sum(os.path.getsize(p) for p in paths) if nbytes is None else int(nbytes)
    jobs = []  # (source, offset, length, destination), in file order
    for i, p in enumerate(paths):
        n = min(left, os.path.getsize(p))
        if n <= 0:
            break
        jobs += [(p, o, min(piece, n - o), os.path.join(out_dir, f"{i}-{o // piece}-{os.path.basename(p)}"))
                 for o in range(0, n, piece)]
        left -= n
    todo, lock, failed, refused, written = iter(jobs), threading.Lock(), [], [], []
    subprocess.run(["sync"], check=True)

    def work() -> None:
        buf = direct_io.aligned_empty((piece,), "uint8")
        try:
            while not failed and not refused:
                with lock:
                    job = next(todo, None)
                if job is None:
                    return
                src_path, off, n, dst = job
                whole = n - n % align
                fd = direct_io.open_direct(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                if fd is None:
                    refused.append(f"{out_dir}: the filesystem refused O_DIRECT at open (EINVAL)")
                    return
                src = os.open(src_path, os.O_RDONLY)
                try:
                    if os.preadv(src, [memoryview(buf)[:n]], off) != n:
                        raise OSError(f"{src_path}: short read at {off}")
                    if whole:
                        try:
                            os.pwrite(fd, memoryview(buf)[:whole], 0)
                        except OSError as e:
                            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                                refused.append(f"{out_dir}: the filesystem refused an O_DIRECT write ({e.strerror})")
                                return
                            raise
                    if n > whole:
                        with open(dst, "r+b") as tail:
                            tail.seek(whole)
                            tail.write(memoryview(buf)[whole:n])
                finally:
                    os.close(src)
                    os.close(fd)
                written.append(dst)
        except BaseException as e:  # (raised by the calling thread)
            failed.append(e)

    try:
        t0 = time.perf_counter()
        run_threads(work, threads)
        if failed:
            raise failed[0]
        if refused:
            return None, refused[0]
        fs = writeback.FilesystemSync.open(out_dir)
        if fs is not None:
            try:
                fs.sync()
            finally:
                fs.close()
        else:
            fsync_files(written)
        writeback.fsync_folder(out_dir)
        return time.perf_counter() - t0, f"O_DIRECT, {threads} threads queued"
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def run_threads(work, threads: int) -> None:
    """Run `work` (no arguments) in `threads` threads at once and wait for them all (a floor's
    workers: each takes its next item from a shared queue and keeps its own errors)."""
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def fsync_files(paths: list[str]) -> None:
    """fsync each of `paths` (files)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_floor(paths: list[str]) -> float:
    """Seconds `cat` takes to read `paths` to /dev/null."""
    t0 = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def files_under(root: str) -> list[str]:
    if os.path.isfile(root):
        return [root]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


QUEUED_PIECES = (8 << 20, 16 << 20)  # bytes a file of the queued O_DIRECT floor: the import's tile size, and twice
# it (3.23 GB, 4 threads, 3 alternating rounds on the 2-core VM: 16 MiB files 1.334 s, 8 MiB 1.387 s,
# 32 MiB 1.352 s, 64 MiB 1.443 s; docs/benchmarks.md "Twentieth stop"): the floor takes the faster
# (in the benchmark runs since, each size was the faster in half the rounds: 12 of 24)


def measure(paths: list[str], scratch: str, *, write_bytes: int | None = None, repeat: int = 2) -> dict:
    """Both floors of `paths` (see the module doc); `write_bytes`: how many bytes the job writes
    (default: the files' size)."""
    total = sum(os.path.getsize(p) for p in paths)
    wb = total if write_bytes is None else int(write_bytes)
    read_floor(paths)  # warm, as the jobs find them
    direct = [direct_write_floor(paths, scratch, wb) for _ in range(repeat)]
    by_piece: dict[int, list[float]] = {}
    for _round in range(repeat):
        for piece in QUEUED_PIECES:
            seconds, _note = queued_direct_write_floor(paths, scratch, wb, piece=piece)
            if seconds is not None:
                by_piece.setdefault(piece, []).append(seconds)
    secs = [s for s, _ in direct if s is not None]
    qsecs = [s for runs in by_piece.values() for s in runs]
    return {
        "write_s": min(write_floor(paths, scratch, wb) for _ in range(repeat)),
        "write_direct_s": min(secs + qsecs) if secs + qsecs else None,  # (the strictest of the ways)
        "write_direct_serial_s": min(secs) if secs else None,
        "write_direct_queued_s": min(qsecs) if qsecs else None,
        "write_direct_queued_by_mib": {piece >> 20: min(runs) for piece, runs in by_piece.items()},
        "direct_note": direct[0][1],
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


def write_cell(seconds: float | None, fl: dict) -> str:
    """Both write floors of `fl` (`measure`'s dict, or one with "write_s" and "write_direct_s"):
    `buffered 0.49 s (1.5x); O_DIRECT 0.30 s (2.4x)`, or the reason O_DIRECT was refused."""
    direct = fl.get("write_direct_s")
    d = cell(seconds, direct) if direct is not None else f"refused ({fl.get('direct_note', 'not measured')})"
    return f"buffered {cell(seconds, fl['write_s'])}; O_DIRECT {d}"


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
