"""The import job: any checkpoint into our Orbax store on a mesh, streamed, with its optimizer.

Open (`jobs.open`) -> the Flax tree by the family's rules (`naming.hf_to_tree`), or, with no model
config, the source's own names as a flat named tree -> the sharding plan (`plan.for_model` /
`plan.for_named`, the generic rule) -> a streaming save (`store.save_checkpoint` over
`store.stream.LazyLeaf`s): no array is ever whole in memory; every leaf is written tile by tile,
read by a pool of `io_threads` readers, so peak host memory is a few tiles, not the checkpoint.
Under `jax.distributed` each process reads and writes only the shards its devices hold; the
per-tensor checksums (`checksum.CHUNKS`, on each tensor's stored chunk grid) are summed across
processes into `trainer_state["checksums"]` (names `params.<path>`, `<slot state name>.<path>`
e.g. `mu.layers.q.kernel`, and `count`), with the grid in `"checksum_chunks"` and the definition
in `"checksum_algorithm"`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.orbax.keys import NAMES_KEY
from hybridckpt.io import byte_source, timing
from hybridckpt.io.gc_pause import loading_modules
from hybridckpt.io.remote import ranged
from hybridckpt.naming import flatten, nest

Progress = Callable[[str, int], None]  # (tensor name, bytes) after each tensor
CRC_TABLES = "chunk_crc32"  # trainer_state key: array name -> its chunks' CRC-32s (`checksum.encode_crcs`)
ARRAY_SPECS = "array_specs"  # trainer_state key: array name -> {"shape", "dtype"} as written
CHECKSUM_KEYS = ("checksums", "checksum_chunks", "checksum_algorithm", CRC_TABLES, ARRAY_SPECS)  # trainer_state keys of an import's
# checksums: a source that is itself one of our imports does not pass its own along


@dataclass(frozen=True)
class ImportSummary:
    source_format: str
    destination: str
    step: int
    mesh: str
    tensors: int
    bytes: int
    seconds: float
    with_optimizer: bool
    notes: tuple[str, ...] = ()
    param_arrays: int = 0  # of `tensors` (all arrays written), those of the params
    source_tensors: int = 0  # the source's param tensors they came from (layers stacked)
    profile: Any = None  # with profile=True: where the time went (`io.timing.Profile`)
    source: str = ""  # what was imported (a URL for a source in object storage)
    requests: Any = None  # a source in object storage: host -> {"requests", "bytes"} asked of it (else {})


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a `--dtype` name (float32, bfloat16, float16): `lazy.dtypes.np_dtype`."""
    from hybridckpt.lazy.dtypes import np_dtype as named_dtype

    return named_dtype(name)


def cast_named(named: Any, dtype: str | None) -> tuple[Any, Any]:
    """(`named` with its floating params cast to `dtype` (None: every tensor as stored; the
    optimizer slots are never cast), the `lazy.dtypes.CastReport`), applied to the source's
    tensors one by one before any rule stacks or fuses them, so a report counts them."""
    from dataclasses import replace

    from hybridckpt.lazy.dtypes import cast_floating

    params, report = cast_floating(named.params, dtype)
    return (named if dtype is None else replace(named, params=params)), report


@dataclass(frozen=True)
class LazyTargets:
    """What an import writes, before anything is read: the leaves (`store.stream.LazyLeaf`: a
    lazy source tensor, its sharding and chunking) of the params and optimizer state, and the
    plan and names they came from. The import saves them; `jobs.plan_report` plans their reads."""

    config: Any
    named: Any
    plan: Any
    optimizer: Any
    mesh: Any
    escaped: dict
    params: dict
    opt_state: Any
    leaves: dict  # storage name ("params.<path>", "<slot state>.<path>") -> LazyLeaf
    counted: dict  # leaves checksummed beyond `leaves` (the step counter)
    options: Any  # the `store.stream.StreamOptions` every leaf shares
    cast: Any = None  # the `lazy.dtypes.CastReport` of `--dtype` (what it cast)


def lazy_targets(
    opened: Any,
    *,
    mesh: Any = "dp=1",
    params_only: bool = False,
    dtype: str | None = None,
    strict_sharding: bool = False,
    progress: Progress | None = None,
    stream_options: Any = None,
    compression: str | None = None,
    direct_io: bool | None = None,
) -> LazyTargets:
    """The import's leaves of an opened checkpoint on `mesh` (arguments as `import_checkpoint`'s);
    reads nothing but what opening read."""

    from hybridckpt import naming, plan
    from hybridckpt.containers.orbax.codec import parse_compression
    from hybridckpt.lazy.dtypes import is_floating
    from hybridckpt.mesh import as_mesh
    from hybridckpt.store import stream

    cfg = opened.config
    escaped: dict[str, str] = {}
    hf, cast = cast_named(opened.named, dtype)  # every tensor as stored unless --dtype
    if cfg is not None:
        named = naming.hf_to_tree(hf, cfg)
    else:  # the source's own names: data, stored under safe keys (`containers.orbax.keys`)
        named, escaped = _under_storage_keys(hf)
    jmesh = as_mesh(mesh)
    opt = None if params_only else named.optimizer
    if opt is not None:
        _check_slots_match_params(named, opened.path)
    if cfg is not None:
        p = plan.for_model(cfg, jmesh, optimizer=opt, indivisible="error" if strict_sharding else "replicate",
                           declared=True)
    else:  # (declared: the optimizer state's tree without optax: the files name only its paths)
        p = plan.for_named(named.params, jmesh, optimizer=opt, declared=True)
    opts = stream_options or stream.StreamOptions()
    opts.on_leaf = progress
    if compression is not None:
        parse_compression(compression)  # a bad value fails before anything is read
        opts.compression = compression
    if direct_io is not None:
        opts.direct_io = bool(direct_io)
    leaves: dict[str, stream.LazyLeaf] = {}
    counted: dict[str, stream.LazyLeaf] = {}  # leaves checksummed beyond `leaves`: the step counter

    def lazy_tree(flat: dict, shardings: Any, to: np.dtype | None, prefix: str) -> dict:
        flat_s, flat_c = flatten(shardings), flatten(p.chunk_axes)
        out = {}
        for k, t in flat.items():
            t = lazy.cast(t, to) if to is not None and is_floating(t.dtype) else t
            out[k] = leaves[prefix + k] = stream.LazyLeaf(t, flat_s[k], prefix + k, tuple(flat_c.get(k, ())), opts)
        return nest(out)

    # (a rule's value op computing in float32 cast back: the leaves are what --dtype asked)
    params = lazy_tree(named.params, p.param_shardings, None if dtype is None else np_dtype(dtype), "params.")
    opt_state = None
    if opt is not None:
        from hybridckpt import optim

        slots = {
            s.name: lazy_tree(named.slots[s.name], p.slot_shardings(s.name), None, f"{s.state_name}.")
            for s in opt.slots
        }
        count = stream.LazyLeaf(
            lazy.ArrayTensor(np.asarray(named.step or 0, dtype=np.int32)), p.step_sharding, "count", options=opts
        )
        counted["count"] = count  # (checksummed like the arrays, not counted among them)
        opt_state = optim.state(opt, p.opt_shapes, slots, count)
        opt_state = _zeros_for_the_rest(opt_state, p, opts)
    return LazyTargets(cfg, named, p, opt, jmesh, escaped, params, opt_state, leaves, counted, opts, cast)


@byte_source.watch()  # every source file read is checked unchanged before the commit
@timing.accounted  # profile=True: the summary's `profile` says where the time went (`io.timing`)
def import_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    fmt: str = "auto",
    mesh: Any = "dp=1",
    config: Any = None,
    rules: str | os.PathLike | None = None,
    params_only: bool = False,
    dtype: str | None = None,
    strict_sharding: bool = False,
    overwrite: bool = False,
    step: int | None = None,
    progress: Progress | None = None,
    io_threads: int | None = None,
    stream_options: Any = None,
    compression: str | None = None,
    direct_io: bool | None = None,
    verify_reads: bool = True,
    param_order: Any = None,
) -> ImportSummary:
    """Import any supported checkpoint into an Orbax checkpoint at `dst` on `mesh`, streaming.

    mesh: a `jax.sharding.Mesh`, a `MeshShape` or a string like "fsdp=2,tp=2,pp=2".
    config: HF config.json / Meta params.json path or a model config, for sources that carry
      none; without any, the tensors are imported under the source's names (generic sharding).
    params_only: leave the optimizer state out. dtype: cast params ("bfloat16", ...).
    strict_sharding: a dimension the mesh cannot divide is an error (default: replicated on that
      axis, with a note in the summary).
    step: which step of a folder of several steps (`open_checkpoint`; default: the latest or the tracked).
    compression: the arrays' codec, "none" (default: raw chunks, the fastest write and the
      file-to-file export), "zstd" (Orbax's default, level 1) or "zstd:LEVEL"; see `store.stream`.
    direct_io: raw chunk files of whole 4 KiB blocks written with O_DIRECT, bypassing the page
      cache (default True; False: buffered writes, refused with a codec: TensorStore writes
      compressed chunks); see `containers.orbax.chunk_files`.
    verify_reads: a hybridckpt (Orbax) source's chunks checked against their import's CRC-32s
      (False for a source of any other format is refused: it records none).
    param_order: an index-keyed optimizer state's parameter names in index order (names, or a file of one a line; `open_checkpoint`).
    profile: also account for the time (`ImportSummary.profile`: seconds, bytes and calls per stage
      and per worker, `io.timing.Profile`); off by default (nothing recorded).
    """
    from hybridckpt.jobs.open import open_checkpoint
    from hybridckpt.lazy import parallel
    from hybridckpt.writers.destination import Destination

    t0 = time.perf_counter()
    asked = ranged.totals()  # a source in a bucket: what this job asks of each host
    if io_threads is not None:
        parallel.set_io_threads(io_threads)
    with timing.stage("open"):
        opened = open_checkpoint(src, fmt, config=config, rules=rules, step=step, verify_reads=verify_reads,
                                 param_order=param_order)
    if "jax" not in sys.modules:  # before any read: the same checks as the save's (one process: JAX not loaded)
        Destination(dst, overwrite=overwrite, sources=[opened.path]).preflight()
    else:  # (JAX loaded, maybe jax.distributed: process 0 checks, every process learns the outcome)
        from hybridckpt.store.save import preflight

        preflight(dst, overwrite=overwrite, sources=[opened.path])
    _check_arguments(mesh, compression, direct_io)
    # JAX (and Orbax, TensorStore) only now: a source, destination, mesh or codec refused above is
    # said without loading them (the CLI's usage errors end in a fraction of JAX's import time)
    loading = time.perf_counter()
    # (the cyclic GC off while they load, and their objects frozen after in the CLI: `io.gc_pause`)
    with timing.stage("start"), loading_modules():  # the modules a first job loads (JAX, Orbax, TensorStore)
        import jax

        from hybridckpt import models
        from hybridckpt.mesh import MeshShape
        from hybridckpt.store import stream
        from hybridckpt.store.layout import HF_FILES
        from hybridckpt.store.save import save_checkpoint
    t0 += time.perf_counter() - loading  # (not the job's own time: its summary's seconds leave it out, as before)
    with timing.stage("plan"):
        lt = lazy_targets(opened, mesh=mesh, params_only=params_only, dtype=dtype, strict_sharding=strict_sharding,
                          progress=progress, stream_options=stream_options, compression=compression, direct_io=direct_io)
    cfg, named, p, opt, jmesh, escaped = lt.config, lt.named, lt.plan, lt.optimizer, lt.mesh, lt.escaped
    params, opt_state, leaves, counted = lt.params, lt.opt_state, lt.leaves, lt.counted
    out_step = int(opened.step or 0)
    trainer = {
        "step": out_step,
        "model_config": models.config_to_dict(cfg) if cfg is not None else None,
        "optimizer": opt.name if opt is not None else None,
        "source": {"format": opened.format, "path": opened.path, "topology": dict(opened.topology)},
        **{k: v for k, v in opened.trainer.items()
           if k not in ("step", "model_config", "mesh", "optimizer", NAMES_KEY, HF_FILES, *CHECKSUM_KEYS)},
    }
    if escaped:
        trainer[NAMES_KEY] = escaped
    hyper_notes: tuple[str, ...] = ()
    if opt is not None and opened.hyper:
        trainer_hyper, hyper_notes = _recorded_hyper(opened, named.params, escaped)
        trainer.update(trainer_hyper)

    def checksums() -> dict:
        from hybridckpt.checksum import CHUNKS, encode_crcs, to_hex
        from hybridckpt.store.save_crcs import gather_crc_tables

        recorded = leaves | counted
        sums = {name: to_hex(leaf.checksum) for name, leaf in recorded.items()}
        tables = {name: leaf.crc_table() for name, leaf in recorded.items()}
        if jax.process_count() > 1:
            sums, tables = _sum_across_processes(sums), gather_crc_tables(tables)
        return {
            "checksum_algorithm": CHUNKS,
            "checksum_chunks": {name: list(leaf.checksum_chunk or leaf.shape) for name, leaf in recorded.items()},
            "checksums": sums,
            CRC_TABLES: {name: encode_crcs(t) for name, t in tables.items()},
            ARRAY_SPECS: {name: {"shape": list(leaf.shape), "dtype": leaf.dtype.name} for name, leaf in recorded.items()},
        }

    set_total = getattr(progress, "set_total", None)
    if set_total is not None:  # every leaf written, the step counter included
        written = jax.tree.leaves((params, opt_state), is_leaf=lambda x: isinstance(x, stream.LazyLeaf))
        set_total(sum(x.nbytes for x in written if isinstance(x, stream.LazyLeaf)))
    save_checkpoint(dst, out_step, params, opt_state, trainer, overwrite=overwrite, trainer_state_after=checksums,
                    sources=[opened.path], files=opened.files.values())
    nbytes = sum(x.nbytes for x in leaves.values())
    notes = opened.notes + opened.named.report + named.report[len(opened.named.report):] + p.notes + hyper_notes
    if lt.cast.note():
        notes += (lt.cast.note(),)
    if cfg is None:
        from hybridckpt.jobs.open import unknown_architecture

        arch = unknown_architecture(opened)
        what = f"{arch}, which no model family implements" if arch else "no model config"
        notes += (
            f"{what}: tensors imported under the source's own names, each sharded by the "
            "generic rule (fsdp on its largest divisible dim, then tp)"
            + ("; an export gives them back as they were, with its config.json" if arch else "; pass --config to import the model"),
        )
    return ImportSummary(
        opened.format, os.fspath(dst), out_step, str(MeshShape.of(jmesh)), len(leaves), nbytes,
        time.perf_counter() - t0, opt is not None, tuple(dict.fromkeys(notes)),
        sum(1 for k in leaves if k.startswith("params.")), len(opened.named.params),
        source=opened.path, requests=ranged.since(asked),
    )


def _check_arguments(mesh: Any, compression: str | None, direct_io: bool | None = None) -> None:
    """The import's arguments that are refused without JAX (`lazy_targets` checks them again, as
    it must for `jobs.plan_report`): a mesh given as text (`MeshShape.parse`), the codec, and
    `direct_io=False` (--buffered-writes) with a codec: compressed chunks are written by
    TensorStore, never by the raw chunk writer that O_DIRECT is a choice of (a flag honoured or
    refused, never ignored)."""
    from hybridckpt.containers.orbax.codec import parse_compression
    from hybridckpt.errors import ConfigError
    from hybridckpt.mesh_shape import MeshShape

    if isinstance(mesh, str):
        MeshShape.parse(mesh)
    codec = parse_compression(compression)[0] if compression is not None else "none"
    if direct_io is False and codec != "none":
        why = (f"the raw chunk files alone are written with O_DIRECT or through the page cache; {compression} "
               "chunks are written by TensorStore, through the page cache always")
        raise ConfigError(f"direct_io=False: {why}", cli=f"--buffered-writes: {why} (drop one of the two)")


def _recorded_hyper(opened: Any, leaves: dict, escaped: dict[str, str]) -> tuple[dict, tuple[str, ...]]:
    """Trainer-state entries for the source's optimizer hyper-parameters: `optimizer_hyper` (lr,
    betas, eps, weight_decay, ...) and, when the param groups decay differently, the
    `weight_decay_mask` over the imported leaves (`optim.groups`). Groups optax cannot express
    are kept as they are (`optimizer_param_groups`), with a note."""
    from hybridckpt.errors import CheckpointError
    from hybridckpt.optim import groups

    to_key = {orig: key for key, orig in escaped.items()}

    def leaf_of(name: str) -> list[str]:
        return [to_key.get(n, n) for n in opened.leaf_of(name)]

    try:
        scalars, mask = groups.weight_decay_mask(opened.hyper, leaf_of, list(leaves), opened.path)
    except CheckpointError as e:
        scalars = {k: v for k, v in opened.hyper.items() if k != "groups"}
        return {"optimizer_hyper": scalars, "optimizer_param_groups": list(opened.hyper.get("groups") or [])}, (
            f"optimizer hyper-parameters recorded, param groups kept as they are: {e}",)
    out: dict = {"optimizer_hyper": scalars}
    if mask is not None:
        out["weight_decay_mask"] = mask
    return out, ()


def _under_storage_keys(named: Any) -> tuple[Any, dict[str, str]]:
    """`named` with every param and slot tensor under its storage key (`containers.orbax.keys`), and the
    escaped keys' original names."""
    from dataclasses import replace

    from hybridckpt.containers.orbax.keys import storage_keys

    keys, escaped = storage_keys({*named.params, *(n for t in named.slots.values() for n in t)})
    return replace(
        named,
        params={keys[n]: t for n, t in named.params.items()},
        slots={s: {keys[n]: t for n, t in ts.items()} for s, ts in named.slots.items()},
    ), escaped


def _check_slots_match_params(named: Any, path: str) -> None:
    """Every optimizer slot holds exactly one tensor per param, under the param's name: else one
    line saying which names differ (e.g. torchtitan's fused `wqkv` moments, which only a model
    config can split like the weights; or frozen params without state)."""
    from hybridckpt.errors import MappingError

    params = set(named.params)
    for slot, tensors in named.slots.items():
        extra, missing = sorted(set(tensors) - params), sorted(params - set(tensors))
        if extra or missing:
            what = (f"state for {extra[:3]}, which is no param's name" if extra
                    else f"no state for params {missing[:3]}")
            raise MappingError(
                f"{path}: optimizer slot {slot!r} has {what} ({len(extra)} extra, {len(missing)} "
                f"missing); pass --config so the model's rules can map it, or --params-only"
            )


def _zeros_for_the_rest(state: Any, p: Any, opts: Any) -> Any:
    """Optimizer state leaves no source holds (beyond slots and step) start at zero."""
    import jax

    from hybridckpt.store import stream

    def fill(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return stream.LazyLeaf(lazy.ArrayTensor(np.zeros(x.shape, x.dtype)), p.step_sharding, options=opts)
        return x

    return jax.tree.map(fill, state, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct | stream.LazyLeaf))


def _sum_across_processes(sums: dict[str, str]) -> dict[str, str]:
    """Add each process's checksum parts (mod 2^64) so every process holds the totals."""
    from jax.experimental import multihost_utils

    from hybridckpt.checksum import combine, to_hex

    names = sorted(sums)
    vals = [int(sums[n], 16) for n in names]
    # 64-bit values as four 16-bit limbs in int32 (jax runs without x64 here)
    limbs = np.array([[(v >> (16 * i)) & 0xFFFF for i in range(4)] for v in vals], dtype=np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(limbs)).astype(np.int64)
    totals = [
        combine(sum(int(g[j, i]) << (16 * i) for i in range(4)) for g in gathered) for j in range(len(names))
    ]
    return {n: to_hex(v) for n, v in zip(names, totals, strict=True)}
