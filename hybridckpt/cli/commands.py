"""One function per CLI command: call the job, print what it did. Exit codes: 0 ok, 1 verify
found differences, 2 an error of the project's family (printed as one line by `cli.main`)."""

from __future__ import annotations

import json
import time

from hybridckpt.cli.output import Progress, compact_json, job_finished, peak_rss_gib, size, summary
from hybridckpt.cli.profile import in_process, launch_clock, print_profile, summary_json
from hybridckpt.errors import ConfigError, HybridCkptError


def cmd_inspect(a) -> int:
    from hybridckpt.jobs.inspect import inspect

    if (a.process is not None or a.processes) and not a.plan:
        raise ConfigError("--process and --processes are only for --plan")
    if a.plan or a.mesh:
        if not (a.plan and a.mesh):
            raise ConfigError("inspect --plan needs --mesh (the target mesh), and --mesh is only for --plan")
        return _print_plan(a, params_only=False, dtype=None, rules=None, strict_sharding=False)
    info = inspect(a.src, a.format, config=a.config, step=a.step, param_order=a.param_order)
    if a.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    step = info.get("step")
    print(f"format:    {info['format']}")
    print(f"path:      {info['path']}")
    print(f"step:      {'-' if step is None else step}")
    steps, default = info.get("steps") or [], info.get("default_step")
    read = default if a.step is None else a.step
    if len(steps) > 1 or (steps and default != read):
        shown = "the one shown" if default == read else f"shown: {read}"
        print(f"steps:     {', '.join(map(str, steps))} (default {'-' if default is None else default}; {shown})")
    print(f"topology:  {compact_json(info['topology']) if info.get('topology') else '-'}")
    if info.get("architecture"):
        print(f"config:    config.json names {info['architecture']}, which no model family implements: its "
              "tensors are read under their own names (inspect, import, export); logits needs a supported model")
    elif info.get("needs_config"):
        print("config:    none in the checkpoint: model-level jobs (logits, import as a model) need "
              "--config (HF config.json or Meta params.json); export and import work on the tensors as they are")
    elif info.get("config"):
        print(f"config:    {compact_json(info['config'])}")
    if info.get("quantization"):
        print(f"quantized: {compact_json(info['quantization'])}")
    if info.get("optimizer"):
        print(f"optimizer: {compact_json(info['optimizer'])}")
    if info.get("files"):
        print(f"files:     {', '.join(info['files'])} (carried into an import and out by an export)")
    for note in info.get("notes", []):
        print(f"note:      {note}")
    tensors = info["tensors"]
    total = sum(_nbytes(t) for t in tensors)
    print(f"tensors:   {len(tensors)} ({size(total)})")
    width = max((len(t["name"]) for t in tensors), default=10)
    for t in tensors:
        print(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<22} {t['dtype']:<9} pieces={t['pieces']}")
    return 0


def _nbytes(t: dict) -> int:
    import math

    import numpy as np

    try:
        itemsize = np.dtype(t["dtype"]).itemsize
    except TypeError:
        import ml_dtypes  # noqa: F401 - registers bfloat16 & co with numpy

        itemsize = np.dtype(t["dtype"]).itemsize
    return math.prod(t["shape"]) * itemsize


def cmd_import(a) -> int:
    from hybridckpt.jobs.import_ import import_checkpoint

    if a.profile and a.plan:
        raise ConfigError("--profile accounts for an import's time: --plan imports nothing")
    if a.replicate_indivisible and a.strict_sharding:  # (the hidden flag of the default the other one turns off)
        raise ConfigError("--replicate-indivisible: the default, which --strict-sharding turns off; give one of the two")
    if (a.process is not None or a.processes) and not a.plan:
        raise ConfigError("--process and --processes are only for --plan")
    if a.plan:
        _refuse_writing_flags(a)
        return _print_plan(a, params_only=a.params_only, dtype=a.dtype, rules=a.rules,
                           strict_sharding=a.strict_sharding)
    from hybridckpt.io import heap

    # The CLI owns its process: the import's reader threads share the malloc arenas, not one each
    # (`io.heap`; process-wide and permanent, so the library's `import_checkpoint` leaves it to its caller)
    heap.share_arenas()
    clock = launch_clock()
    with Progress("import", a.quiet) as prog:
        s = import_checkpoint(
            a.src, a.dst, fmt=a.format, mesh=a.mesh, config=a.config, rules=a.rules, param_order=a.param_order,
            params_only=a.params_only, dtype=a.dtype, strict_sharding=a.strict_sharding,
            overwrite=a.overwrite, progress=prog, io_threads=a.io_threads, compression=a.compression,
            direct_io=not a.buffered_writes, verify_reads=not a.no_verify_reads, step=a.step,
            profile=a.profile or a.json,
        )
    s = in_process(s, clock)
    job_finished()
    if a.json:
        print(json.dumps(summary_json(s), indent=2))
        return 0
    print(f"imported {s.source_format} checkpoint into {s.destination} at step {s.step} on mesh {s.mesh}"
          f" ({_devices_used(s.mesh)}; {'with' if s.with_optimizer else 'without'} optimizer state)")
    for n in s.notes:
        print(f"note: {n}")
    print(f"arrays: {s.param_arrays} param arrays from {s.source_tensors} source tensors"
          f"{' (layers stacked)' if s.param_arrays < s.source_tensors else ''}"
          f", {s.tensors - s.param_arrays} optimizer arrays")
    print(summary("arrays", s.tensors, s.bytes, s.seconds))
    for host, r in (s.requests or {}).items():  # a source in object storage: what it was asked for
        print(f"read from {host}: {r['requests']} requests, {size(r['bytes'])}")
    if s.profile is not None:
        print_profile(s.profile)
    return 0


def _refuse_writing_flags(a) -> None:
    """`import --plan` plans from metadata and writes nothing: the flags that only shape the
    writing or the reading of tensor bytes have nothing to act on there, and are refused (a flag
    honoured or refused, never ignored) rather than left out of a plan that looks as if it took them."""
    given = [(flag, why) for flag, on, why in (
        ("--overwrite", a.overwrite, "DST is not touched"),
        ("--compression", a.compression != "none", "the plan counts the raw bytes to write, before any codec"),
        ("--buffered-writes", a.buffered_writes, "nothing is written"),
        ("--no-verify-reads", a.no_verify_reads, "no chunk is read"),
        ("--io-threads", a.io_threads is not None, "no tensor byte is read"),
    ) if on]
    if given:
        flag, why = given[0]
        raise ConfigError(f"{flag}: not for --plan, which reads metadata alone and writes nothing ({why}); "
                          "drop it, or drop --plan to import")


def _print_plan(a, **options) -> int:
    """`import --plan` / `inspect --plan`: the import's plan (`jobs.plan_report`), as text or JSON."""
    from hybridckpt.jobs.plan_report import plan_import

    plan = plan_import(a.src, fmt=a.format, mesh=a.mesh, config=a.config, step=a.step, process=a.process,
                       param_order=a.param_order,
                       processes=a.processes, **options)
    if a.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    print(f"plan of an import of {plan.source_format} {plan.source} onto mesh {plan.mesh}: {plan.tensors} arrays, "
          f"{size(plan.tensor_bytes)} (nothing written; planned in {plan.seconds:.1f} s)")

    def line(who: str, x) -> str:
        gaps = f" (+{size(x.gap_bytes)} between close runs)" if x.gap_bytes else ""
        runs = f" of {x.runs} runs" if x.runs > x.reads else ""  # runs joined into spans and preadv batches
        asked = "".join(f"; from {host}: {r['requests']} requests, {size(r['bytes'])}" for host, r in x.requests.items())
        return (f"{who}: bytes read {size(x.bytes_read)}{gaps} in {x.reads} reads{runs} from {len(x.files)} files, "
                f"bytes written {size(x.bytes_written)} in {x.tiles} tiles{asked}")

    for p in plan.processes:
        print(line(f"process {p.process}", p))
        for d in plan.devices:
            if d.process == p.process:
                print("  " + line(f"device {d.device}", d))
    for n in plan.notes:
        print(f"note: {n}")
    return 0


def _devices_used(mesh: str) -> str:
    """`N of M devices`: a mesh uses the first N (its sizes' product) of the M present."""
    import jax

    from hybridckpt.mesh import MeshShape

    return f"{MeshShape.parse(mesh).size} of {jax.device_count()} devices"


def writer_options(a) -> dict:
    """The `--to` format's own options from the flags given (`--writers`, `--tp`, `--pp`,
    `--no-scan-layers`, `--optimizer-layout`; `formats.registry.write` refuses those the format
    does not take)."""
    options = {}
    for flag, key, value in (("--writers", "files", a.writers), ("--tp", "tp", a.tp), ("--pp", "pp", a.pp)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: expected a positive number")
        if value is not None:
            options[key] = value
    if a.scan_layers is not None:
        options["scan_layers"] = a.scan_layers
    if a.optimizer_layout is not None:
        options["optimizer_layout"] = a.optimizer_layout
    return options


def cmd_export(a) -> int:
    from hybridckpt.jobs.export import export_checkpoint

    clock = launch_clock()
    with Progress("export", a.quiet) as prog:
        s = export_checkpoint(
            a.src, a.out, fmt=a.format, step=a.step, optimizer=a.optimizer, config=a.config, param_order=a.param_order,
            rules=a.rules, dtype=a.dtype,
            max_shard_bytes=int(a.max_shard_gb * 1024**3) if a.max_shard_gb else None,
            overwrite=a.overwrite, progress=prog, io_threads=a.io_threads, to=a.to,
            direct_io=not a.buffered_writes, verify_reads=not a.no_verify_reads,
            options=writer_options(a), profile=a.profile or a.json,
        )
    s = in_process(s, clock)
    job_finished()
    if a.json:
        print(json.dumps(summary_json(s), indent=2))
        return 0
    print(f"exported {s.source_format} checkpoint to {s.destination}: {', '.join(s.files)}")
    for n in s.notes:
        print(f"note: {n}")
    print(summary("tensors", s.tensors, s.bytes, s.seconds))
    if s.profile is not None:
        print_profile(s.profile)
    return 0


def cmd_verify(a) -> int:
    from hybridckpt.jobs.verify import compared, verify, verify_checksums

    t0 = time.perf_counter()
    with Progress("verify", a.quiet) as prog:
        if a.b is None:
            if a.param_order is not None:
                raise ConfigError("--param-order: only for comparing two checkpoints (verify A B), whose "
                                  "optimizer state it names")
            given = [flag for flag, on in (("--config", a.config is not None), ("--atol", a.atol != 0.0),
                                           ("--params-only", a.params_only),
                                           ("--no-verify-reads", a.no_verify_reads)) if on]
            if given:  # (re-reading one of ours against its CRC-32s takes none of them)
                raise ConfigError(f"{given[0]}: only for comparing two checkpoints (verify A B); verify A alone "
                                  f"re-reads every array of A against the checksums its import recorded")
            rows = verify_checksums(a.a, step=a.step, progress=prog)
            bad = [r for r in rows if not r.ok]
            for r in bad:
                print(f"BAD {r.name}: {r.reason or 'checksum differs'}")
            files = [r for r in rows if r.kind == "file"]
            arrays = len(rows) - len(files)
            kept = f", {sum(r.ok for r in files)}/{len(files)} carried config and tokenizer files" if files else ""
            print(f"{arrays - sum(r.kind != 'file' for r in bad)}/{arrays} arrays match their import checksums{kept}; "
                  f"{time.perf_counter() - t0:.2f} s")
            return 1 if bad else 0
        rows, only_a, only_b = verify(a.a, a.b, atol=a.atol, config=a.config, progress=prog, step=a.step, param_order=a.param_order,
                                      params_only=a.params_only, verify_reads=not a.no_verify_reads)
    width = max((len(r.name) for r in rows), default=10)
    bad = 0
    for r in rows:
        mark = "ok " if r.ok else "BAD"
        bad += not r.ok
        if not a.quiet or not r.ok:
            what = f"max|a-b| = {r.max_abs_diff:.3g}" if r.kind in ("param", "slot") else (r.reason or "equal")
            print(f"{mark} {r.name:<{width}} {what}")
    for n in only_a:
        print(f"BAD {n}: only in {a.a}")
    for n in only_b:
        print(f"BAD {n}: only in {a.b}")
    bad += len(only_a) + len(only_b)
    total = len(rows) + len(only_a) + len(only_b)
    print(f"compared {compared(rows)}")
    print(f"{total - bad}/{total} items match (atol={a.atol}); "
          f"{time.perf_counter() - t0:.2f} s, peak memory {peak_rss_gib():.2f} GiB")
    return 1 if bad else 0


def cmd_logits(a) -> int:
    import numpy as np

    from hybridckpt.jobs.logits import check_out, logits, save

    if a.out is not None:
        check_out(a.out)  # before the forward pass: a path that cannot be written is said at once
    try:
        tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        raise HybridCkptError(f"--tokens: expected comma-separated integers, found {a.tokens!r}") from None
    if not tokens:
        raise HybridCkptError(f"--tokens: expected at least one token id, found {a.tokens!r}")
    out = logits(a.src, tokens, mesh=a.mesh, config=a.config, fmt=a.format, step=a.step, param_order=a.param_order,
                 compute_dtype=a.compute_dtype, verify_reads=not a.no_verify_reads)
    if a.out is not None:
        print(f"logits {out.shape} float32 written to {save(a.out, out)}")
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        print(f"logits {out.shape}; argmax per position: {out[0].argmax(-1).tolist()}")
        print(out[0, :, : min(8, out.shape[-1])])
    return 0


def cmd_demo(a) -> int:
    from hybridckpt import demo

    return demo.run(workdir=a.workdir, keep=a.keep)
