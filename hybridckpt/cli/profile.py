"""What `--profile` prints and `--json` carries: a job's account of its time (`io.timing.Profile`).

The table: one line per stage (its share of the wall time, its wall-clock and busy seconds, the
bytes it moved and their rate per busy second), "other/waiting" (the wall time no stage
covered), the wall time they sum to, then one line per worker thread: its busy seconds and bytes
in each stage it entered.

Run as the `hybridckpt` command (`cli.run`, the process is the command's own), the account covers
the process from its start: a stage "launch" (Python's start and the CLI's modules, until the job
was called) comes first, and the job's call outside its own account is other/waiting
(`io.timing.Profile.in_process`); called in-process (`cli.main` from a script or a test), the
account is the job's alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from hybridckpt.cli.output import size
from hybridckpt.io import timing

_own_process = [False]  # set by the console entry point (`cli.run`): the process is this command's


def own_process() -> None:
    """Mark this process as the command's own (`cli.run`): its account starts at the process's start."""
    _own_process[0] = True


def launch_clock() -> tuple[float | None, float]:
    """(the process's age now, when the process is the command's own, else None; `perf_counter`
    now): taken just before a command calls its job, for `in_process`."""
    return (timing.process_age_s() if _own_process[0] else None), time.perf_counter()


def in_process(summary: Any, clock: tuple[float | None, float]) -> Any:
    """`summary` with its profile widened to the process (`Profile.in_process`; `clock` from
    `launch_clock`); as it is without a profile, or when the process is not the command's own."""
    launch, t0 = clock
    if summary.profile is None or launch is None:
        return summary
    return dataclasses.replace(summary, profile=summary.profile.in_process(launch, time.perf_counter() - t0))


def summary_json(summary: Any) -> dict:
    """A job summary (`ImportSummary`, `ExportSummary`) as plain JSON, its profile included."""
    out = {f.name: getattr(summary, f.name) for f in dataclasses.fields(summary) if f.name != "profile"}
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
    out["profile"] = summary.profile.to_json() if summary.profile is not None else None
    return out


def profile_lines(profile: Any) -> list[str]:
    """The `--profile` table of `profile` (see the module doc)."""
    lines = [f"{'stage':<14}{'share s':>9}{'wall s':>9}{'busy s':>9}{'bytes':>11}{'MB/s':>9}{'calls':>8}"]
    for s in profile.stages:
        rate = f"{s.mb_per_s:.1f}" if s.bytes and s.busy_s > 0 else "-"
        lines.append(f"{s.stage:<14}{s.share_s:>9.3f}{s.wall_s:>9.3f}{s.busy_s:>9.3f}"
                     f"{size(s.bytes) if s.bytes else '-':>11}{rate:>9}{s.calls:>8}")
    lines.append(f"{'other/waiting':<14}{profile.other_s:>9.3f}")
    lines.append(f"{'wall':<14}{profile.wall_s:>9.3f}   (the shares and other/waiting sum to it; busy: "
                 f"summed over workers)")
    workers: dict[str, list[str]] = {}
    for w in profile.workers:
        moved = f" {size(w.bytes)}" if w.bytes else ""
        workers.setdefault(w.worker, []).append(f"{w.stage} {w.busy_s:.3f} s{moved}")
    lines.append("per worker (busy seconds, bytes):")
    lines += [f"  {name}: {', '.join(parts)}" for name, parts in workers.items()]
    return lines


def print_profile(profile: Any) -> None:
    print("\n".join(profile_lines(profile)))
