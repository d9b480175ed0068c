"""The export job: any checkpoint (ours included) to one folder of any layout a writer offers
(`hybridckpt.writers`: an HF single-card safetensors folder by default), streamed.

- With a model config: the model's tensors under HF names (`naming.model_hf`: every name and
  shape checked against the model, buffers and tied copies dropped), `config.json`,
  `generation_config.json` and the source's tokenizer files (`formats.hf.files`), and with
  `optimizer=True` the optimizer slots as `optimizer*.safetensors` (`<hf name>.<slot>`, `step`).
  The checkpoint goes to HF names once, when it is opened; the export writes those tensors.
- Without one (model-agnostic): every tensor under the source's own names, tensor-parallel and
  ZeRO pieces joined, with the slots when asked: the job of `dcp_to_torch_save` and
  `zero_to_fp32`, in bounded memory.

Streams (the HF writer, `formats.hf.write.write_export`): each tensor is read (by `io_threads`
readers, ahead of the writer within a window of the largest tensor up to `WRITE_BLOCK_BYTES`) and written before the next ones are read; a larger one
is read and written in blocks of rows of that size, so peak host memory is a couple of blocks
(our raw Orbax store, read without JAX or Orbax, exports in under 256 MiB whatever its size:
docs/benchmarks.md "The Orbax write and read paths"); tensors whose bytes already lie in the source files in the order they must be written
are copied file to file without being materialised (`lazy.copy_runs`: through the O_DIRECT
write buffer of `io.sequential_file`, or by the kernel with `--buffered-writes`). Our Orbax
store is read lazily too (`containers.orbax.reader`: a layer of a stacked leaf reads only its chunks).
Between torch-side formats no JAX is imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridckpt.io import byte_source, timing
from hybridckpt.io.gc_pause import loading_modules

Progress = Callable[[str, int], None]  # (tensor name, bytes) after each tensor


@dataclass(frozen=True)
class ExportJob:
    """How to export: `export_checkpoint(src, out, **fields)`'s fields (src: the checkpoint, any
    format, ours included; out: the folder to create).

    fmt: the source's format ("auto" detects it); step: which step of a folder of several
      (`open_checkpoint`); config: a config path or model config for sources that carry none
      (omit it to consolidate under the source's own names); rules: a user rules file;
      param_order: the parameter names in index order of an optimizer state keyed by index
      (a sequence, or a file of one name a line: `open_checkpoint`).
    optimizer: also write the optimizer slots and step (a source without any: the weights alone,
      with a note saying so). dtype: cast the floating params on write (the summary's notes say
      what was cast); default: every tensor as stored.
    to: the format written (`formats.registry.TO_NAMES`: "hf", the Paddle unified layouts, the
      torch trainers' "dcp", "torchtitan", "megatron", "maxtext").
    options: that format's own options (`formats.registry.Format.options`: `files` for dcp and
      torchtitan (the `__R_0.distcp` files), `tp`, `pp` for megatron (the parallel sizes the chunks
      follow), `scan_layers` for maxtext); any other is refused. max_shard_bytes: the largest
      file (hf, the Paddle layouts) or chunk (the torch layouts: a larger tensor is saved as row
      blocks); refused for maxtext (Orbax lays out its own files).
    direct_io: files written with O_DIRECT through two aligned buffers (default; False: through
      the page cache, runs copied file to file by the kernel): `io.sequential_file`; False is
      refused for maxtext and the Paddle layouts (their writers take no O_DIRECT path).
    verify_reads: a hybridckpt (Orbax) source's chunks checked against their import's CRC-32s
      (False for a source of any other format is refused: it records none).
    io_threads: parallel byte-range readers; progress: called (tensor name, bytes) per tensor.
    profile: also account for the time (`ExportSummary.profile`: seconds, bytes and calls per
      stage and per worker, `io.timing.Profile`); off by default (nothing recorded).
    """

    fmt: str = "auto"
    step: int | None = None
    optimizer: bool = False
    config: Any = None
    param_order: Any = None
    rules: str | os.PathLike | None = None
    dtype: str | None = None
    to: str = "hf"
    options: Mapping[str, Any] = field(default_factory=dict)
    max_shard_bytes: int | None = None
    overwrite: bool = False
    direct_io: bool = True
    verify_reads: bool = True
    io_threads: int | None = None
    progress: Progress | None = None
    profile: bool = False


@dataclass(frozen=True)
class ExportSummary:
    source_format: str
    destination: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float
    with_optimizer: bool
    notes: tuple[str, ...] = ()
    profile: Any = None  # with ExportJob.profile: where the time went (`io.timing.Profile`)


def export_checkpoint(src: str | os.PathLike, out: str | os.PathLike, **fields: Any) -> ExportSummary:
    """Any supported checkpoint (Orbax included) -> one folder at `out` in the format `to`
    (HF safetensors by default); `fields` are `ExportJob`'s (an unknown one is a TypeError)."""
    return run(src, out, ExportJob(**fields))


@byte_source.watch()  # every source file read is checked unchanged before the commit
def run(src: str | os.PathLike, out: str | os.PathLike, job: ExportJob) -> ExportSummary:
    """Open `src` (names decided once: only the model's tensors with a config), then write `out`
    with the format's writer (`formats.registry.write`: the destination checked before any read);
    with `job.profile`, the summary's `profile` accounts for the time (`io.timing`)."""
    return _run(src, out, job, profile=job.profile)


@timing.accounted
def _run(src: str | os.PathLike, out: str | os.PathLike, job: ExportJob) -> ExportSummary:
    with timing.stage("start"), loading_modules():  # the modules a first job loads (`io.gc_pause`)
        from hybridckpt.formats import registry
        from hybridckpt.jobs.open import open_checkpoint
        from hybridckpt.lazy import parallel
        from hybridckpt.writers import ExportRequest

    t0 = time.perf_counter()
    knobs = tuple(k for k, given in (("max_shard_bytes", job.max_shard_bytes is not None),
                                     ("direct_io", not job.direct_io)) if given)
    registry.writing(job.to, job.options, job.optimizer, knobs)  # a target, option or knob it does not take: refused before anything is read
    if job.io_threads is not None:
        parallel.set_io_threads(job.io_threads)
    with timing.stage("open"):
        opened = open_checkpoint(src, job.fmt, config=job.config, rules=job.rules, step=job.step,
                                 verify_reads=job.verify_reads, model_only=True, param_order=job.param_order)
    named = opened.named
    optimizer = job.optimizer and bool(named.slots)  # the weights alone, and said: the flag had nothing to write
    notes = () if optimizer == job.optimizer else (
        f"{opened.path} holds no optimizer state (weights only): the weights are exported without it",)
    done = registry.write(ExportRequest(
        job.to, os.fspath(out), named, opened.config, optimizer=optimizer, dtype=job.dtype,
        max_shard_bytes=job.max_shard_bytes, overwrite=job.overwrite, progress=job.progress, direct_io=job.direct_io,
        sources=(opened.path,), source_format=opened.format, trainer=dict(opened.trainer), files=dict(opened.files),
        hyper=dict(opened.hyper), options=dict(job.options),
    ))  # fmt: skip
    return ExportSummary(opened.format, _shown(out), done.files, done.tensors, done.nbytes,
                         time.perf_counter() - t0, optimizer, notes + tuple(opened.notes) + done.notes)


def _shown(out: str | os.PathLike) -> str:
    """The destination as the summary names it: a URL as given, a local path made absolute."""
    from hybridckpt.io.remote.urls import parse

    url = parse(out)
    return str(url) if url is not None else os.path.abspath(out)
