"""(h) Metadata at the size of real runs: reading what is where in a 405B checkpoint of many ranks.

A sparse DCP checkpoint shaped like Llama 3.1 405B trained with FSDP2 (model + AdamW moments +
step: 4548 tensors, `benchmarks/scale_sources.py`: torch's own planner and `FileSystemWriter`
write the `.metadata`, the `.distcp` files are sparse) at each `--ranks`; on it, each in a fresh
process, alternating, `--repeats` times:

- torch: `FileSystemReader(path).read_metadata()` (torch's own metadata read, the least a
  torch-based loader does before reading a byte);
- after: `hybridckpt inspect PATH` of this tree (the whole command: metadata, checks of every
  chunk, the files' sizes, the family's names, the printed summary);
- before: the same command from another source tree (`--before DIR`, e.g. `git archive` of main
  unpacked there; skipped when not given; `--before-repeats` runs, 1 by default: it is slow).

Each row: the median wall time of the timed call in the process (imports excluded) and the median
peak RSS of the process (`ru_maxrss`, imports included), and the ratios to torch's medians of
the same run. `--json FILE` writes every sample.

    python benchmarks/scale_metadata.py --root /tmp/scale [--ranks 64 256] [--repeats 3]
                                        [--before /tmp/main_tree] [--before-repeats 1] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)

_CHILD = r"""
import io, json, os, resource, sys, time, contextlib
kind, path = sys.argv[1], sys.argv[2]
if kind == "torch":
    from torch.distributed.checkpoint import FileSystemReader
    t0 = time.perf_counter()
    md = FileSystemReader(path).read_metadata()
    n = sum(len(getattr(e, "chunks", ())) for e in md.state_dict_metadata.values())
else:
    from hybridckpt.cli import main
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = main(["inspect", path])
    assert rc == 0, out.getvalue()[-2000:]
    n = None
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": dt, "peak_rss": rss, "chunks": n}))
"""


def run_one(kind: str, path: str, before: str | None) -> dict:
    """One fresh process: `kind` (torch / after / before) on the checkpoint at `path`."""
    env = dict(os.environ)
    if kind == "before":
        env["PYTHONPATH"] = before + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    p = subprocess.run([sys.executable, "-c", _CHILD, "torch" if kind == "torch" else "inspect", path],
                       env=env, capture_output=True, text=True, cwd="/", check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} on {path} failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def source(root: str, ranks: int, log) -> tuple[str, dict]:
    """The checkpoint of `ranks` ranks under `root` (written once, then reused)."""
    sys.path.insert(0, HERE)
    import scale_sources

    path = os.path.join(root, f"llama405b_{ranks}")
    info_path = os.path.join(path, "scale_source.json")
    if not os.path.isfile(info_path):
        log(f"writing the {ranks}-rank source at {path} (torch's planner: minutes)")
        scale_sources.write(path, scale_sources.llama_params(scale_sources.LLAMA_405B), scale_sources.fsdp(ranks),
                            ranks, config=scale_sources.LLAMA_405B, log=log)
    with open(info_path) as f:
        return path, json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="where the sparse sources are (written if absent)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", help="a source tree of the version to compare with (PYTHONPATH)")
    ap.add_argument("--before-repeats", type=int, default=1, help="runs of `before` (it is the slow one)")
    ap.add_argument("--json", help="write every sample here")
    a = ap.parse_args(argv)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    kinds = ["torch", "after"] + (["before"] if a.before else [])
    samples: dict = {}
    rows = []
    for ranks in a.ranks:
        path, info = source(a.root, ranks, log)
        got = {k: [] for k in kinds}
        for i in range(a.repeats):
            for k in kinds if i % 2 == 0 else kinds[::-1]:  # alternate the order
                if k == "before" and i >= a.before_repeats:
                    continue
                t0 = time.perf_counter()
                got[k].append(run_one(k, path, a.before))
                log(f"  {ranks} ranks {k}: {got[k][-1]['seconds']:.1f} s, "
                    f"{got[k][-1]['peak_rss'] / 2**30:.2f} GiB ({time.perf_counter() - t0:.0f} s with imports)")
        samples[ranks] = {"source": info, "runs": got}
        med = {k: (statistics.median(r["seconds"] for r in v), statistics.median(r["peak_rss"] for r in v))
               for k, v in got.items()}
        rows.append((ranks, info, med))
    print("| ranks | chunks | `.metadata` | " + " | ".join(
        {"torch": "torch `read_metadata`", "after": "`hybridckpt inspect`", "before": "`inspect` before"}[k]
        for k in kinds) + " | after / torch (time, memory) |")
    print("|---" * (4 + len(kinds)) + "|")
    for ranks, info, med in rows:
        cells = [f"{med[k][0]:.1f} s, {med[k][1] / 2**30:.2f} GiB" for k in kinds]
        ratio = f"{med['after'][0] / med['torch'][0]:.2f}x, {med['after'][1] / med['torch'][1]:.2f}x"
        print(f"| {ranks} | {info['chunks'] / 1000:.0f}k | {info['metadata_bytes'] / 2**20:.0f} MiB | "
              + " | ".join(cells) + f" | {ratio} |")
    print(f"(medians of {a.repeats} fresh processes each ({a.before_repeats} for before), alternating; time: "
          "the timed call, imports excluded; memory: the process's peak RSS, imports included)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
