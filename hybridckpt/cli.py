"""`hybridckpt` command line: inspect, import, export, verify, logits, demo.

Errors of the project's family print one line and exit 2 (`--debug` shows the traceback);
`verify` exits 1 when tensors differ. Long jobs show a progress bar on a terminal and end with a
summary: tensors, bytes, GB/s, peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import traceback

from hybridckpt.errors import HybridCkptError

FORMAT_CHOICES = ["auto", "hf", "orbax", "megatron", "meta-llama", "dcp", "deepspeed", "paddle", "paddle-unified", "colossal"]


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def _summary(tensors: int, nbytes: int, seconds: float) -> str:
    gbs = nbytes / 1e9 / seconds if seconds > 0 else 0.0
    return (
        f"{tensors} tensors, {nbytes / 1e6:.1f} MB in {seconds:.2f} s ({gbs:.2f} GB/s), "
        f"peak memory {_peak_rss_gib():.2f} GiB"
    )


class _Progress:
    """A rich progress bar over bytes on stderr when it is a terminal; silent otherwise."""

    def __init__(self, what: str, quiet: bool = False):
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn(f"{what} [progress.description]{{task.description}}"),
                BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True,
            )
            self.task = self.bar.add_task("", total=None)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def __call__(self, name: str, nbytes: int) -> None:
        if self.bar:
            self.bar.update(self.task, advance=nbytes, description=name[-40:])


def _simulate_host_devices(count: int = 8) -> None:
    """On CPU, let meshes of up to `count` devices run by simulating host devices. Must run
    before jax initialises; it changes nothing on GPU hosts (the flag is CPU-only)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


# -- commands ---------------------------------------------------------------------------------


def cmd_inspect(a) -> int:
    from hybridckpt.jobs.inspect import inspect

    info = inspect(a.src, a.format, config=a.config)
    if a.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"format:    {info['format']}")
    print(f"path:      {info['path']}")
    print(f"step:      {info.get('step')}")
    print(f"topology:  {info.get('topology') or '-'}")
    if info.get("needs_config"):
        print("config:    none in the checkpoint: pass --config (HF config.json or Meta params.json)")
    elif info.get("config"):
        print(f"config:    {info['config']}")
    if info.get("optimizer"):
        print(f"optimizer: {info['optimizer']}")
    for note in info.get("notes", []):
        print(f"note:      {note}")
    tensors = info["tensors"]
    print(f"tensors:   {len(tensors)}")
    width = max((len(t["name"]) for t in tensors), default=10)
    for t in tensors:
        print(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<22} {t['dtype']:<9} pieces={t['pieces']}")
    return 0


def cmd_import(a) -> int:
    from hybridckpt.jobs.import_ import import_checkpoint

    with _Progress("import", a.quiet) as prog:
        s = import_checkpoint(
            a.src, a.dst, fmt=a.format, mesh=a.mesh, config=a.config, rules=a.rules,
            params_only=a.params_only, dtype=a.dtype,
            indivisible="replicate" if a.replicate_indivisible else "error",
            overwrite=a.overwrite, progress=prog, io_threads=a.io_threads,
        )
    print(f"imported {s.source_format} checkpoint into {s.destination} at step {s.step} on mesh {s.mesh}"
          f" ({'with' if s.with_optimizer else 'without'} optimizer state)")
    for n in s.notes:
        print(f"note: {n}")
    print(_summary(s.tensors, s.bytes, s.seconds))
    return 0


def cmd_export(a) -> int:
    from hybridckpt.jobs.export import export_checkpoint

    with _Progress("export", a.quiet) as prog:
        s = export_checkpoint(
            a.src, a.out, fmt=a.format, step=a.step, optimizer=a.optimizer, config=a.config,
            rules=a.rules, dtype=a.dtype,
            max_shard_bytes=int(a.max_shard_gb * 1024**3) if a.max_shard_gb else None,
            overwrite=a.overwrite, progress=prog, io_threads=a.io_threads,
        )
    print(f"exported {s.source_format} checkpoint to {s.destination}: {', '.join(s.files)}")
    print(_summary(s.tensors, s.bytes, s.seconds))
    return 0


def cmd_verify(a) -> int:
    import time

    from hybridckpt.jobs.verify import verify, verify_checksums

    t0 = time.perf_counter()
    with _Progress("verify", a.quiet) as prog:
        if a.b is None:
            rows, only_a, only_b = verify_checksums(a.a, progress=prog), [], []
            bad = [r for r in rows if not r.ok]
            if bad:
                print(f"BAD {bad[0].name}: checksum differs from the one recorded at import "
                      f"(first of {len(bad)} bad arrays)")
            print(f"{len(rows) - len(bad)}/{len(rows)} arrays match their import checksums; "
                  f"{time.perf_counter() - t0:.2f} s")
            return 1 if bad else 0
        rows, only_a, only_b = verify(a.a, a.b, atol=a.atol, config=a.config, progress=prog)
    width = max((len(r.name) for r in rows), default=10)
    bad = 0
    for r in rows:
        mark = "ok " if r.ok else "BAD"
        bad += not r.ok
        if not a.quiet or not r.ok:
            print(f"{mark} {r.name:<{width}} max|a-b| = {r.max_abs_diff:.3g}")
    for n in only_a:
        print(f"BAD {n}: only in {a.a}")
    for n in only_b:
        print(f"BAD {n}: only in {a.b}")
    bad += len(only_a) + len(only_b)
    total = len(rows) + len(only_a) + len(only_b)
    print(f"{total - bad}/{total} tensors match (atol={a.atol}); "
          f"{time.perf_counter() - t0:.2f} s, peak memory {_peak_rss_gib():.2f} GiB")
    return 1 if bad else 0


def cmd_logits(a) -> int:
    import numpy as np

    from hybridckpt.jobs.logits import logits

    try:
        tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        raise HybridCkptError(f"--tokens: expected comma-separated integers, found {a.tokens!r}") from None
    out = logits(a.src, tokens, mesh=a.mesh, config=a.config, fmt=a.format, compute_dtype=a.compute_dtype)
    if a.out:
        np.save(a.out, out)
        print(f"logits {out.shape} float32 written to {a.out}")
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        print(f"logits {out.shape}; argmax per position: {out[0].argmax(-1).tolist()}")
        print(out[0, :, : min(8, out.shape[-1])])
    return 0


def cmd_demo(a) -> int:
    from hybridckpt import demo

    return demo.run(workdir=a.workdir, keep=a.keep)


# -- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridckpt",
        description="Move training checkpoints (weights and optimizer state) between parallel layouts "
        "and frameworks as sharded JAX arrays.",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp, *, fmt=True, config=True, io=False):
        if fmt:
            sp.add_argument("--format", default="auto", choices=FORMAT_CHOICES, help="source format (default: detect)")
        if io:
            sp.add_argument("--io-threads", type=int, metavar="N",
                            help="parallel byte-range readers (default: $HYBRIDCKPT_IO_THREADS, else 2 x cores, 4..16)")
        if config:
            sp.add_argument("--config", help="HF config.json or Meta params.json, for sources that carry no model config")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("inspect", help="format, topology, step and tensors of a checkpoint")
    s.add_argument("src")
    s.add_argument("--json", action="store_true", help="print JSON")
    common(s)
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("import", help="any supported checkpoint -> Orbax checkpoint on a mesh")
    s.add_argument("src")
    s.add_argument("dst", help="Orbax checkpoint directory to create")
    s.add_argument("--mesh", default="dp=1", help="target mesh, e.g. dp=1,fsdp=2,tp=2,pp=2 (default: one device)")
    s.add_argument("--params-only", action="store_true", help="do not import optimizer state")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast params (default: as stored)")
    s.add_argument("--rules", help="a rules file applied before the format's own rules (model variants)")
    s.add_argument("--replicate-indivisible", action="store_true",
                   help="replicate a dimension the mesh cannot divide instead of failing")
    s.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    common(s, io=True)
    s.set_defaults(fn=cmd_import)

    s = sub.add_parser(
        "export", help="Orbax or any supported checkpoint -> single-card HF safetensors",
        description=(
            "Write SRC as one single-card Hugging Face checkpoint at OUT, tensor by tensor (the job "
            "of torch's dcp_to_torch_save and DeepSpeed's zero_to_fp32). Tensors whose bytes are "
            "stored in order (FSDP2 and ZeRO shards, dim-0 splits) are copied file to file by the "
            "kernel and never enter memory; the rest are read and written one at a time. OUT "
            "appears complete (fsync'd, renamed into place) or not at all."
        ),
    )
    s.add_argument("src", help="checkpoint folder or file of any supported format")
    s.add_argument("out", help="folder to create (model*.safetensors, config.json)")
    s.add_argument("--step", type=int, help="Orbax step (default: latest)")
    s.add_argument("--optimizer", action="store_true", help="also write optimizer.safetensors (exp_avg, exp_avg_sq, step)")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast params on write")
    s.add_argument("--rules", help="a rules file applied before the format's own rules")
    s.add_argument("--max-shard-gb", type=float, help="shard size above which files are split (default 5)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    common(s, io=True)
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser(
        "verify",
        help="compare two checkpoints tensor by tensor (HF names), or re-check an imported Orbax "
        "checkpoint against its recorded checksums (one argument); exit 1 on mismatch",
    )
    s.add_argument("a")
    s.add_argument("b", nargs="?", help="the second checkpoint (omit to check A's checksums)")
    s.add_argument("--atol", type=float, default=0.0, help="allowed max abs difference (default 0: bitwise)")
    common(s, fmt=False)
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("logits", help="run the model's forward pass on tokens")
    s.add_argument("src")
    s.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    s.add_argument("--out", help="write the logits to this .npy file")
    s.add_argument("--mesh", default="dp=1")
    s.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    common(s)
    s.set_defaults(fn=cmd_logits)

    s = sub.add_parser("demo", help="import, reshard, export and verify a built-in sample (no other install needed)")
    s.add_argument("--workdir", help="where to write (default: a temporary directory)")
    s.add_argument("--keep", action="store_true", help="keep the workdir")
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _simulate_host_devices()
    try:
        return args.fn(args)
    except HybridCkptError as e:
        if args.debug:
            traceback.print_exc()
        msg = " ".join(str(e).split())
        print(f"hybridckpt: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybridckpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
