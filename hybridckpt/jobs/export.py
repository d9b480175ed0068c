"""The export job: any checkpoint (ours included) to one folder of any layout a writer offers
(`hybridckpt.writers`: an HF single-card safetensors folder by default), streamed.

- With a model config: the model's tensors under HF names (`naming.model_hf`: every name and
  shape checked against the model, buffers and tied copies dropped), `config.json`,
  `generation_config.json` and the source's tokenizer files (`writers.hf_files`), and with
  `optimizer=True` the optimizer slots as `optimizer*.safetensors` (`<hf name>.<slot>`, `step`).
  The checkpoint goes to HF names once, when it is opened; the export writes those tensors.
- Without one (model-agnostic): every tensor under the source's own names, tensor-parallel and
  ZeRO pieces joined, with the slots when asked: the job of `dcp_to_torch_save` and
  `zero_to_fp32`, in bounded memory.

Streams (the HF writer, `writers.hf_folder.write_export`): each tensor is read (by `io_threads`
readers, ahead of the writer within a window of the largest tensor up to `WRITE_BLOCK_BYTES`) and written before the next ones are read; a larger one
is read and written in blocks of rows of that size, so peak host memory is a couple of blocks
(our raw Orbax store, read without JAX or Orbax, exports in under 256 MiB whatever its size:
docs/benchmarks.md "The Orbax write and read paths"); tensors whose bytes already lie in the source files in the order they must be written
are copied file to file without being materialised (`lazy.copy_runs`: through the O_DIRECT
write buffer of `io.sequential_file`, or by the kernel with `--buffered-writes`). Our Orbax
store is read lazily too (`store.reader`: a layer of a stacked leaf reads only its chunks).
Between torch-side formats no JAX is imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.io import byte_source

Progress = Callable[[str, int], None]  # (tensor name, bytes) after each tensor
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


def exported_hyper(opened: Any, names: set[str]) -> dict:
    """The source's optimizer hyper-parameters with each param group's params under the exported
    names (`opened.hf_of`: HF names with a model config), those not exported left out."""
    hyper = dict(opened.hyper)
    groups = hyper.pop("groups", None)
    if groups:
        hyper["groups"] = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [h for n in g.get("params") or [] for h in opened.hf_of(str(n)) if h in names]}
            for g in groups
        ]
    return hyper


def _writer_extra(to: str, scan_layers: bool) -> dict:
    """Writer options; `maxtext` gets the store's streaming Orbax save (the store is above the writers)."""
    if to != "maxtext":
        return {}
    from hybridckpt.store.maxtext import save_state

    return {"scan_layers": scan_layers, "save_state": save_state}


def _optimizer_layout(layout: str | None, to: str, optimizer: bool) -> dict:
    """The writer option of `optimizer_layout`, checked before anything is read: only with
    `optimizer` and `to="hf"`."""
    if layout is None:
        return {}
    from hybridckpt.errors import ConfigError
    from hybridckpt.formats.trainer.write import LAYOUTS

    if layout not in LAYOUTS:
        raise ConfigError(f"--optimizer-layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if to != "hf":
        raise ConfigError(f"--optimizer-layout: only for --to hf (not --to {to})")
    if not optimizer:
        raise ConfigError(f"--optimizer-layout {layout}: only with --optimizer (it says how the optimizer state is written)")
    return {"optimizer_layout": layout}


@byte_source.watch()  # every source file read is checked unchanged before the commit
def export_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fmt: str = "auto",
    step: int | None = None,
    optimizer: bool = False,
    config: Any = None,
    rules: str | os.PathLike | None = None,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    io_threads: int | None = None,
    to: str = "hf",
    direct_io: bool = True,
    verify_reads: bool = True,
    layout: Mapping[str, int] | None = None,
    scan_layers: bool = True,
    optimizer_layout: str | None = None,
) -> ExportSummary:
    """Any supported checkpoint (Orbax included) -> one safetensors folder at `out`.

    optimizer: also write the optimizer slots and step (a source without any: the weights alone,
      with a note saying so). dtype: cast the floating params on write (the summary's notes say
      what was cast); default: every tensor as stored.
    config: a config path or model config for sources that carry none (omit it to consolidate
      under the source's own names). step: which step of a folder of several (`open_checkpoint`).
    to: "hf", or a Paddle unified layout ("paddlenlp-unified", "paddleformers-unified":
      `writers/paddle_unified.py`), or a torch trainer's ("dcp", "torchtitan", "megatron":
      `writers.torch_dcp`, `writers.torchtitan`, `writers.megatron_dist`).
    layout: for the torch trainers' layouts, how the files are split: `writers` (DCP files),
      `tp`, `pp` (Megatron's parallel sizes the chunks follow); `max_shard_bytes` is then the
      largest chunk (a larger tensor is saved as row blocks).
    direct_io: the HF safetensors files written with O_DIRECT through two aligned buffers (default;
      False: through the page cache, runs copied file to file by the kernel): `io.sequential_file`.
    verify_reads: a hybridckpt (Orbax) source's chunks checked against their import's CRC-32s.
    scan_layers: `to="maxtext"`: layers stacked on MaxText's scan axis (default) or one per layer.
    optimizer_layout: `to="hf"` with `optimizer`: "safetensors" (default: `optimizer*.safetensors`)
      or "trainer" (the HF Trainer's `optimizer.pt`, `scheduler.pt`, `trainer_state.json`:
      `formats.trainer.write`); refused otherwise.
    """
    from hybridckpt import naming, writers
    from hybridckpt.jobs.import_ import np_dtype
    from hybridckpt.jobs.open import open_checkpoint
    from hybridckpt.lazy import parallel
    from hybridckpt.lazy.dtypes import cast_floating
    from hybridckpt.writers.destination import Destination

    t0 = time.perf_counter()
    extra = _optimizer_layout(optimizer_layout, to, optimizer)
    if io_threads is not None:
        parallel.set_io_threads(io_threads)
    opened = open_checkpoint(src, fmt, config=config, rules=rules, step=step, verify_reads=verify_reads)
    Destination(out, overwrite=overwrite, sources=[opened.path]).preflight()  # before any read
    named = naming.model_hf(opened.named, opened.config) if opened.config is not None else opened.named
    _, cast = cast_floating(named.params, dtype)  # what the writer casts (through the same helper)
    notes: tuple[str, ...] = ()
    if optimizer and not named.slots:  # the weights alone, and said: the flag had nothing to write
        optimizer = False
        notes = (f"{opened.path} holds no optimizer state (weights only): the weights are exported without it",)
    done = writers.write(writers.ExportRequest(
        to, os.fspath(out), named, opened.config, optimizer=optimizer, dtype=np_dtype(dtype) if dtype else None,
        max_shard_bytes=max_shard_bytes, overwrite=overwrite, progress=progress, direct_io=direct_io,
        sources=(opened.path,), source_format=opened.format, trainer=dict(opened.trainer), files=dict(opened.files),
        hyper=exported_hyper(opened, set(named.params)) if opened.hyper else {}, extra={**dict(layout or {}), **_writer_extra(to, scan_layers), **extra},
    ))
    cast_note = (cast.note(),) if cast.note() else ()
    return ExportSummary(opened.format, os.path.abspath(out), done.files, done.tensors, done.nbytes,
                         time.perf_counter() - t0, optimizer, notes + tuple(opened.notes) + done.notes + cast_note)
