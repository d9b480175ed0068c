"""The jobs behind the CLI: import into Orbax, export to single-card HF, verify, logits, inspect.

Each job is a function with plain arguments that returns a small summary dataclass; printing
and exit codes live in `hybridckpt.cli`. JAX, Flax and Orbax are imported inside the jobs that
use them: an export between two torch-side formats, `inspect` and `verify` of such files never
load them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridckpt import convert, lazy
from hybridckpt.errors import CheckpointError, ConfigError, MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import load_rules

if TYPE_CHECKING:
    from hybridckpt.mesh import MeshShape

Progress = Callable[[str, int], None]  # (tensor name, bytes) after each tensor


def load_config_file(path: str, vocab_size: int | None = None):
    """A model config from an HF `config.json` or a Meta `params.json`."""
    import models

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
    if "dim" in data and "n_layers" in data:
        return models.config_from_meta_params(data, vocab_size=vocab_size)
    return models.config_from_hf(data)


@dataclass(frozen=True)
class Opened:
    """Any checkpoint seen under HF names: config, params, moments, step and metadata."""

    format: str
    path: str
    config: Any
    hf: convert.Named
    trainer: Mapping[str, Any] = field(default_factory=dict)
    topology: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def open_hf(
    path: str,
    fmt: str = "auto",
    *,
    config_path: str | None = None,
    rules_path: str | None = None,
    step: int | None = None,
    strict: bool = True,
) -> Opened:
    """Open any supported checkpoint (an Orbax one included) as HF-named lazy tensors."""
    from hybridckpt import formats

    cfg = load_config_file(config_path) if config_path else None
    fmt = formats.detect(path) if fmt == "auto" else fmt
    if fmt == "orbax":
        from hybridckpt.formats import orbax as orbax_fmt

        return orbax_fmt.open_hf(path, step=step, config=cfg)
    src = formats.open_source(path, fmt, config=cfg)
    cfg = cfg or src.config
    if cfg is None:
        raise ConfigError(
            f"{path}: this {src.format} checkpoint carries no model config; pass --config "
            f"with an HF config.json or a Meta params.json"
        )
    user = None
    if rules_path:
        user = load_rules(rules_path, convert.rule_variables(cfg))
    hf = convert.source_to_hf(src, cfg, user_rules=user, strict=strict)
    return Opened(src.format, path, cfg, hf, dict(src.trainer), dict(src.topology), tuple(src.notes) + hf.notes)


# -- import ---------------------------------------------------------------------------------------


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



def import_checkpoint(
    src_path: str,
    dst: str,
    *,
    fmt: str = "auto",
    mesh: MeshShape | str = "dp=1",
    config_path: str | None = None,
    rules_path: str | None = None,
    params_only: bool = False,
    dtype: str | None = None,
    indivisible: str = "error",
    overwrite: bool = False,
    step: int | None = None,
    progress: Progress | None = None,
    io_threads: int | None = None,
    stream_options: Any = None,
) -> ImportSummary:
    """Import any supported checkpoint into an Orbax checkpoint at `dst` on `mesh`, streaming.

    No array is ever whole in memory: every leaf is a `stream.LazyLeaf` that Orbax writes tile
    by tile (read by a pool of `io_threads` readers, default `$HYBRIDCKPT_IO_THREADS`), so peak
    host memory is a few tiles (`stream.StreamOptions`), not the checkpoint. Under
    `jax.distributed` each process reads and writes only the shards its devices hold; the
    per-tensor checksums are summed across processes into `trainer_state["checksums"]`.
    """
    import jax

    import models
    from hybridckpt import stream
    from hybridckpt.checkpoint import save_checkpoint
    from hybridckpt.io import parallel
    from hybridckpt.mesh import MeshShape, mesh_from_shape, opt_state_shardings, tree_shardings
    from hybridckpt.restore import adamw_state

    t0 = time.perf_counter()
    if io_threads is not None:
        parallel.set_io_threads(io_threads)
    opened = open_hf(src_path, fmt, config_path=config_path, rules_path=rules_path, step=step)
    cfg = opened.config
    tree = convert.hf_to_tree(opened.hf, cfg)
    shape = MeshShape.parse(mesh) if isinstance(mesh, str) else mesh
    jmesh = mesh_from_shape(shape)
    shapes = models.param_shapes(cfg)
    axes = models.logical_axes(cfg)
    p_shard = tree_shardings(shapes, axes, jmesh, indivisible=indivisible)
    np_dtype = None if dtype is None else _np_dtype(dtype)
    opts = stream_options or stream.StreamOptions()
    opts.on_leaf = progress
    leaves: dict[str, stream.LazyLeaf] = {}

    def lazy_tree(flat: dict[str, LazyTensor], cast, prefix: str) -> dict:
        out = convert.lazy_leaves(
            convert.nest(flat), p_shard, cast, options=opts, prefix=prefix,
            chunk_axes=_stacked_axes(axes),
        )
        leaves.update({prefix + k: v for k, v in convert.flatten(out).items()})
        return out

    params = lazy_tree(tree.params, np_dtype, "params.")
    opt_state = None
    with_opt = not params_only and tree.exp_avg is not None
    if with_opt:
        f32 = np.dtype(np.float32)
        mu = lazy_tree(tree.exp_avg, f32, "mu.")
        nu = lazy_tree(tree.exp_avg_sq, f32, "nu.")
        count = np.asarray(tree.step or 0, dtype=np.int32)
        abstract = adamw_state(shapes, shapes, shapes, 0)
        o_shard = opt_state_shardings(abstract, p_shard, jmesh)
        count_leaf = stream.LazyLeaf(
            lazy.ArrayTensor(count), o_shard[0].count, "count", options=opts
        )
        first = abstract[0]._replace(count=count_leaf, mu=mu, nu=nu)
        opt_state = (first,) + tuple(abstract[1:])
    out_step = int(opened.hf.step or 0) if step is None else int(step)
    trainer = {
        "step": out_step,
        "model_config": models.config_to_dict(cfg),
        "source": {"format": opened.format, "path": os.path.abspath(src_path), "topology": dict(opened.topology)},
        **{k: v for k, v in opened.trainer.items() if k not in ("step", "model_config", "mesh")},
    }

    def checksums() -> dict:
        from hybridckpt.checksum import to_hex

        sums = {name: to_hex(leaf.checksum) for name, leaf in leaves.items()}
        return {"checksums": _sum_across_processes(sums) if jax.process_count() > 1 else sums}

    save_checkpoint(dst, out_step, params, opt_state, trainer, overwrite=overwrite, trainer_state_after=checksums)
    nbytes = sum(x.nbytes for x in leaves.values())
    return ImportSummary(
        opened.format, dst, out_step, str(shape), len(leaves), nbytes,
        time.perf_counter() - t0, with_opt, opened.notes + opened.hf.report,
    )


def _stacked_axes(axes: Any) -> Any:
    """Per leaf: `(0,)` when its first logical axis is `layers` (chunk it per layer), else ()."""
    import jax

    return jax.tree.map(
        lambda a: (0,) if a and a[0] == "layers" else (), axes, is_leaf=lambda x: isinstance(x, tuple)
    )


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


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    if name in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float32", "fp32"):
        return np.dtype(np.float32)
    if name in ("float16", "fp16"):
        return np.dtype(np.float16)
    raise ConfigError(f"unknown --dtype {name!r}: expected float32, bfloat16 or float16")


# -- export ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportSummary:
    source_format: str
    destination: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float
    with_optimizer: bool


def export_checkpoint(
    src_path: str,
    out: str,
    *,
    fmt: str = "auto",
    step: int | None = None,
    optimizer: bool = False,
    config_path: str | None = None,
    rules_path: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    io_threads: int | None = None,
) -> ExportSummary:
    """Any supported checkpoint (Orbax included) -> single-card HF safetensors at `out`.

    Streams: each tensor is read (by `io_threads` readers, ahead of the writer within a window
    of the largest tensor) and written before the next ones are read, so peak host memory is a
    couple of tensors; tensors whose bytes lie in the source files as they must be written are
    copied file to file without being read (`lazy.copy_runs`). An Orbax source is read lazily too (`hybridckpt.orbax_lazy`: a layer of
    a stacked leaf reads only that layer's chunks), never restored whole.
    """
    import models
    from hybridckpt import formats
    from hybridckpt.export import DEFAULT_SHARD_BYTES, write_hf
    from hybridckpt.io import parallel

    t0 = time.perf_counter()
    if io_threads is not None:
        parallel.set_io_threads(io_threads)
    kind = formats.detect(src_path) if fmt == "auto" else fmt
    if kind == "orbax":
        opened = _open_orbax_lazy(src_path, step=step, config_path=config_path)
    else:
        opened = open_hf(src_path, kind, config_path=config_path, rules_path=rules_path, step=step)
    cfg = opened.config
    # route through the model tree so every export has exactly the model's tensors, named by
    # the inverse of the model rules
    tree = convert.hf_to_tree(opened.hf, cfg)
    inv = convert.model_rules(cfg).invert()
    params = inv.apply_unstack(tree.params).tensors
    if dtype is not None:
        params = {k: lazy.cast(v, _np_dtype(dtype)) for k, v in params.items()}
    exp_avg = exp_avg_sq = None
    if optimizer:
        if tree.exp_avg is None:
            raise CheckpointError(f"{src_path}: has no optimizer state to export (drop --optimizer)")
        exp_avg = inv.apply_unstack(tree.exp_avg).tensors
        exp_avg_sq = inv.apply_unstack(tree.exp_avg_sq).tensors
    all_t = list(params.values()) + (list(exp_avg.values()) + list(exp_avg_sq.values()) if optimizer else [])
    # read ahead in the order write_hf writes: model tensors by name, then the moments by name
    staged: dict[tuple[str, str], LazyTensor] = {("model", k): v for k, v in params.items()}
    for suffix, moments in ((".exp_avg", exp_avg), (".exp_avg_sq", exp_avg_sq)):
        staged |= {("optimizer", k + suffix): v for k, v in (moments or {}).items()}
    # tensors the writer copies file to file (`lazy.copy_runs`) are not read ahead
    staged = {k: v for k, v in staged.items() if lazy.copy_runs(v) is None}
    order = sorted(k for k in staged if k[0] == "model") + sorted(k for k in staged if k[0] == "optimizer")
    window = max((t.nbytes for t in all_t), default=0)
    ahead = parallel.Prefetcher(staged, order, window).tensors()
    params = {k: ahead.get(("model", k), v) for k, v in params.items()}
    if optimizer:
        exp_avg = {k: ahead.get(("optimizer", k + ".exp_avg"), v) for k, v in exp_avg.items()}
        exp_avg_sq = {k: ahead.get(("optimizer", k + ".exp_avg_sq"), v) for k, v in exp_avg_sq.items()}
    hf_cfg = models.config_to_hf(cfg)
    trainer = {"step": opened.hf.step, "source_format": opened.format}
    files = write_hf(
        out, params, hf_cfg, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=opened.hf.step,
        trainer=trainer, max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES,
        overwrite=overwrite, on_tensor=progress,
    )
    return ExportSummary(
        opened.format, out, tuple(files), len(all_t), sum(t.nbytes for t in all_t),
        time.perf_counter() - t0, optimizer,
    )


def _open_orbax_lazy(path: str, *, step: int | None = None, config_path: str | None = None) -> Opened:
    """An Orbax checkpoint (`DIR` or `DIR/<step>`) under HF names, every array a lazy
    `orbax_lazy.OrbaxArray` (nothing restored)."""
    import models
    from hybridckpt.checkpoint import latest_step, read_trainer_state
    from hybridckpt.orbax_lazy import item_arrays

    root, base = os.path.normpath(path), os.path.basename(os.path.normpath(path))
    if base.isdigit() and os.path.isdir(os.path.join(root, "params")):
        root, step = os.path.dirname(root), int(base) if step is None else step
    step = latest_step(root) if step is None else step
    if step is None:
        raise CheckpointError(f"{root}: no checkpoint steps")
    state = read_trainer_state(root, step)
    if config_path:
        cfg = load_config_file(config_path)
    elif "model_config" in state:
        cfg = models.config_from_dict(state["model_config"])
    else:
        raise ConfigError(f"{root}: trainer_state has no model_config; pass --config")
    step_dir = os.path.join(root, str(step))
    params = item_arrays(os.path.join(step_dir, "params"))
    exp_avg = exp_avg_sq = None
    opt_step = state.get("step", step)
    if os.path.isdir(os.path.join(step_dir, "opt_state")):
        opt = item_arrays(os.path.join(step_dir, "opt_state"))
        exp_avg = {k[len("0.mu."):]: v for k, v in opt.items() if k.startswith("0.mu.")}
        exp_avg_sq = {k[len("0.nu."):]: v for k, v in opt.items() if k.startswith("0.nu.")}
        if "0.count" in opt:
            opt_step = int(opt["0.count"].materialize())
    inv = convert.model_rules(cfg).invert()
    hf = convert.Named(
        inv.apply_unstack(params).tensors,
        inv.apply_unstack(exp_avg).tensors if exp_avg else None,
        inv.apply_unstack(exp_avg_sq).tensors if exp_avg_sq else None,
        opt_step,
    )
    return Opened("orbax", path, cfg, hf, state, dict(state.get("mesh", {})))


# -- verify ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorDiff:
    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    ok: bool


def compare_tensors(
    a: Mapping[str, LazyTensor], b: Mapping[str, LazyTensor], atol: float = 0.0, on_tensor: Progress | None = None
) -> tuple[list[TensorDiff], list[str], list[str]]:
    """Per-tensor max |a - b| (in float64), plus names only in a and only in b."""
    rows = []
    for name in sorted(set(a) & set(b)):
        ta, tb = a[name], b[name]
        if ta.shape != tb.shape:
            rows.append(TensorDiff(name, tuple(ta.shape), float("inf"), False))
            continue
        xa = ta.materialize().astype(np.float64)
        xb = tb.materialize().astype(np.float64)
        both_nan = np.isnan(xa) & np.isnan(xb)
        d = np.where(both_nan, 0.0, np.abs(xa - xb))
        diff = float(d.max()) if d.size else 0.0
        rows.append(TensorDiff(name, tuple(ta.shape), diff, diff <= atol))
        if on_tensor:
            on_tensor(name, ta.nbytes)
    return rows, sorted(set(a) - set(b)), sorted(set(b) - set(a))


def verify(a: str, b: str, *, atol: float = 0.0, config_path: str | None = None, progress: Progress | None = None):
    """Compare two checkpoints of any formats tensor by tensor under HF names."""
    oa = open_hf(a, config_path=config_path)
    ob = open_hf(b, config_path=config_path)
    ta = _model_hf(oa)
    tb = _model_hf(ob)
    return compare_tensors(ta, tb, atol, progress)


def _model_hf(opened: Opened) -> dict[str, LazyTensor]:
    tree = convert.hf_to_tree(opened.hf, opened.config)
    return convert.model_rules(opened.config).invert().apply_unstack(tree.params).tensors


def verify_checksums(path: str, *, step: int | None = None, progress: Progress | None = None) -> list[TensorDiff]:
    """Re-read every array of an Orbax checkpoint written by `import` and compare its checksum
    with the one recorded at import (`trainer_state["checksums"]`); max_abs_diff is 0 or inf."""
    from hybridckpt import checksum
    from hybridckpt.formats import orbax as orbax_fmt

    cfg, state, params, opt_state = orbax_fmt.restore_host(path, step=step)
    recorded = state.get("checksums")
    if not recorded:
        raise CheckpointError(f"{path}: no checksums recorded (only `hybridckpt import` records them)")
    arrays = {f"params.{k}": v for k, v in convert.flatten(params).items()}
    if opt_state is not None:
        arrays |= {f"mu.{k}": v for k, v in convert.flatten(opt_state[0].mu).items()}
        arrays |= {f"nu.{k}": v for k, v in convert.flatten(opt_state[0].nu).items()}
    rows = []
    for name in sorted(set(recorded) | set(arrays)):
        if name not in arrays:
            rows.append(TensorDiff(name, (), float("inf"), False))
            continue
        x = arrays[name]
        ok = name in recorded and checksum.to_hex(checksum.of_array(x)) == recorded[name]
        rows.append(TensorDiff(name, tuple(x.shape), 0.0 if ok else float("inf"), ok))
        if progress:
            progress(name, x.nbytes)
    return rows


# -- logits ---------------------------------------------------------------------------------------


def logits(
    src_path: str,
    tokens: list[int] | np.ndarray,
    *,
    mesh: MeshShape | str = "dp=1",
    config_path: str | None = None,
    fmt: str = "auto",
    compute_dtype: str = "float32",
) -> np.ndarray:
    """The model's logits `[batch, seq, vocab]` (fp32) for `tokens` on `mesh`."""
    import jax
    import jax.numpy as jnp

    import models
    from hybridckpt.mesh import MeshShape, mesh_from_shape, tree_shardings

    opened = open_hf(src_path, fmt, config_path=config_path)
    cfg = opened.config
    tree = convert.hf_to_tree(opened.hf, cfg)
    jmesh = mesh_from_shape(MeshShape.parse(mesh) if isinstance(mesh, str) else mesh)
    shard = tree_shardings(models.param_shapes(cfg), models.logical_axes(cfg), jmesh, indivisible="replicate")
    params = convert.assemble(convert.nest(tree.params), shard, np.float32)
    toks = np.asarray(tokens, dtype=np.int32)
    if toks.ndim == 1:
        toks = toks[None]
    if toks.size and (toks.min() < 0 or toks.max() >= cfg.vocab_size):
        raise MappingError(f"tokens must lie in [0, {cfg.vocab_size}), found {toks.min()}..{toks.max()}")
    cd = jnp.bfloat16 if compute_dtype in ("bfloat16", "bf16") else jnp.float32
    fn = jax.jit(lambda p, t: models.forward(cfg, p, t, compute_dtype=cd))
    return np.asarray(fn(params, toks))


# -- inspect --------------------------------------------------------------------------------------


def inspect(path: str, fmt: str = "auto", *, config_path: str | None = None) -> dict:
    """Format, topology, step and tensors (name, global shape, dtype) of a checkpoint."""
    from hybridckpt import formats

    fmt = formats.detect(path) if fmt == "auto" else fmt
    cfg = load_config_file(config_path) if config_path else None
    if fmt == "orbax":
        from hybridckpt.formats import orbax as orbax_fmt

        return orbax_fmt.inspect(path)
    src = formats.open_source(path, fmt, config=cfg)
    info: dict[str, Any] = {
        "format": src.format,
        "path": path,
        "step": src.step,
        "topology": dict(src.topology),
        "config": None,
        "needs_config": (cfg or src.config) is None,
        "tensors": [
            {"name": k, "shape": list(t.shape), "dtype": str(np.dtype(t.dtype)), "pieces": _pieces(t)}
            for k, t in src.tensors.items()
        ],
        "optimizer": None,
        "notes": list(src.notes),
    }
    if cfg or src.config:
        import models

        info["config"] = models.config_to_dict(cfg or src.config)
    if src.optimizer:
        info["optimizer"] = {
            "step": src.optimizer.step,
            "moments": len(src.optimizer.exp_avg),
            "master_weights": len(src.optimizer.master),
        }
    return info


def _pieces(t: LazyTensor) -> int:
    """How many stored pieces a lazy tensor is made of."""
    if isinstance(t, lazy.StoredTensor):
        return 1
    kids = [getattr(t, a) for a in ("src", "stored", "flat") if isinstance(getattr(t, a, None), LazyTensor)]
    kids += list(getattr(t, "parts", ()) or ())
    return sum(_pieces(k) for k in kids) if kids else 1


