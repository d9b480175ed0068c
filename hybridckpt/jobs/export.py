"""The export job: any checkpoint (ours included) to one single-card safetensors folder, streamed.

- With a model config: the model's tensors under HF names (`naming.model_hf`: every name and
  shape checked against the model, buffers and tied copies dropped), `config.json`, and with
  `optimizer=True` the optimizer slots as `optimizer*.safetensors` (`<hf name>.<slot>`, `step`).
  The checkpoint goes to HF names once, when it is opened; the export writes those tensors.
- Without one (model-agnostic): every tensor under the source's own names, tensor-parallel and
  ZeRO pieces joined, with the slots when asked: the job of `dcp_to_torch_save` and
  `zero_to_fp32`, in bounded memory.

Streams: each tensor is read (by `io_threads` readers, ahead of the writer within a window of the
largest tensor up to `WRITE_BLOCK_BYTES`) and written before the next ones are read; a larger one
is read and written in blocks of rows of that size, so peak host memory is a couple of blocks
(our raw Orbax store, read without JAX or Orbax, exports in under 256 MiB whatever its size:
README "The Orbax write and read paths"); tensors whose bytes already lie in the source files in the order they must be written
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

from hybridckpt import lazy
from hybridckpt.errors import CheckpointError
from hybridckpt.lazy import LazyTensor

Progress = Callable[[str, int], None]  # (tensor name, bytes) after each tensor
# `--to` layouts of torch trainers: the module writing each (its `write_request`)
TORCH_TARGETS = {
    "dcp": "hybridckpt.writers.torch_dcp",
    "torchtitan": "hybridckpt.writers.torchtitan",
    "megatron": "hybridckpt.writers.megatron_dist",
}


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
) -> ExportSummary:
    """Any supported checkpoint (Orbax included) -> one safetensors folder at `out`.

    optimizer: also write the optimizer slots and step. dtype: cast params on write.
    config: a config path or model config for sources that carry none (omit it to consolidate
      under the source's own names). step: which step of a hybridckpt (Orbax) source.
    to: "hf", or a Paddle unified layout ("paddlenlp-unified", "paddleformers-unified":
      `writers/paddle_unified.py`), or a torch trainer's ("dcp", "torchtitan", "megatron":
      `TORCH_TARGETS`).
    layout: for the torch trainers' layouts, how the files are split: `writers` (DCP files),
      `tp`, `pp` (Megatron's parallel sizes the chunks follow); `max_shard_bytes` is then the
      largest chunk (a larger tensor is saved as row blocks).
    direct_io: the HF safetensors files written with O_DIRECT through two aligned buffers (default;
      False: through the page cache, runs copied file to file by the kernel): `io.sequential_file`.
    verify_reads: a hybridckpt (Orbax) source's chunks checked against their import's CRC-32s.
    """
    from hybridckpt import naming
    from hybridckpt.containers.safetensors_file import WRITE_BLOCK_BYTES
    from hybridckpt.jobs.import_ import np_dtype
    from hybridckpt.jobs.open import open_checkpoint
    from hybridckpt.lazy import parallel
    from hybridckpt.writers.destination import Destination
    from hybridckpt.writers.hf_folder import DEFAULT_SHARD_BYTES, write_hf

    t0 = time.perf_counter()
    if io_threads is not None:
        parallel.set_io_threads(io_threads)
    opened = open_checkpoint(src, fmt, config=config, rules=rules, step=step, verify_reads=verify_reads)
    Destination(out, overwrite=overwrite, sources=[opened.path]).preflight()  # before any read
    cfg = opened.config
    named = naming.model_hf(opened.named, cfg) if cfg is not None else opened.named
    if to in TORCH_TARGETS:
        return _export_torch(opened, named, out, to, t0, optimizer=optimizer, dtype=dtype, overwrite=overwrite,
                             progress=progress, direct_io=direct_io, max_shard_bytes=max_shard_bytes,
                             layout=layout or {})  # fmt: skip
    if to != "hf":  # Paddle's unified layouts (writers/paddle_unified.py)
        from hybridckpt.writers.paddle_unified import write_export

        if optimizer and not named.slots:
            raise CheckpointError(f"{opened.path}: has no optimizer state to export (drop --optimizer)")
        files = write_export(os.fspath(out), named.params, cfg, layout=to, slots=named.slots if optimizer else None,
                             step=named.step, dtype=np_dtype(dtype) if dtype else None, overwrite=overwrite,
                             sources=(opened.path,), betas=opened.trainer.get("adam_betas"))
        nbytes = sum(t.nbytes for t in named.params.values())
        return ExportSummary(opened.format, os.path.abspath(out), tuple(files), len(named.params), nbytes,
                             time.perf_counter() - t0, optimizer, opened.notes)
    params = dict(named.params)
    if dtype is not None:
        params = {k: lazy.cast(v, np_dtype(dtype)) for k, v in params.items()}
    slots: dict[str, dict[str, LazyTensor]] = {}
    if optimizer:
        if not named.slots:
            raise CheckpointError(f"{opened.path}: has no optimizer state to export (drop --optimizer)")
        slots = {s: dict(t) for s, t in named.slots.items()}
    # read ahead in the order write_hf writes: model tensors by name, then optimizer tensors
    # by name (`<name>.<slot>`); tensors the writer copies file to file are not read ahead
    staged: dict[tuple[str, str], LazyTensor] = {("model", k): v for k, v in params.items()}
    for slot, tensors in slots.items():
        staged |= {("optimizer", f"{k}.{slot}"): v for k, v in tensors.items()}
    all_t = list(staged.values())
    # tensors the writer copies file to file, or reads and writes in row blocks (larger than
    # `WRITE_BLOCK_BYTES`), are not read ahead: the read-ahead window is at most one block
    staged = {k: v for k, v in staged.items() if v.nbytes <= WRITE_BLOCK_BYTES and lazy.copy_runs(v) is None}
    order = sorted(k for k in staged if k[0] == "model") + sorted(k for k in staged if k[0] == "optimizer")
    window = max((t.nbytes for t in staged.values()), default=0)
    ahead = parallel.Prefetcher(staged, order, window).tensors()
    params = {k: ahead.get(("model", k), v) for k, v in params.items()}
    slots = {s: {k: ahead.get(("optimizer", f"{k}.{s}"), v) for k, v in t.items()} for s, t in slots.items()}
    set_total = getattr(progress, "set_total", None)
    if set_total is not None:
        set_total(sum(t.nbytes for t in all_t))
    hf_cfg = None
    if cfg is not None:
        from hybridckpt import models

        hf_cfg = models.config_to_hf(cfg)
    trainer = {"step": named.step, "source_format": opened.format}
    if slots:
        trainer["optimizer_name"] = named.optimizer.name
    files = write_hf(
        os.fspath(out), params, hf_cfg, slots=slots or None, step=named.step,
        with_step=bool(slots) and named.optimizer.has_step, trainer=trainer,
        max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES, overwrite=overwrite, on_tensor=progress,
        direct_io=direct_io, sources=(opened.path,),
    )
    return ExportSummary(
        opened.format, os.path.abspath(out), tuple(files), len(all_t), sum(t.nbytes for t in all_t),
        time.perf_counter() - t0, bool(slots), opened.notes,
    )


def _export_torch(opened, named, out, to, t0, *, optimizer, dtype, overwrite, progress, direct_io,
                  max_shard_bytes, layout) -> ExportSummary:  # fmt: skip
    """`--to dcp|torchtitan|megatron`: the request handed to the target's writer
    (`TORCH_TARGETS`, its `write_request`: writers/torch_request.py), which streams it."""
    import importlib

    from hybridckpt.jobs.import_ import np_dtype
    from hybridckpt.writers.torch_request import TorchRequest

    if optimizer and not named.slots:
        raise CheckpointError(f"{opened.path}: has no optimizer state to export (drop --optimizer)")
    request = TorchRequest(
        os.fspath(out), named, opened.config, optimizer=optimizer, dtype=np_dtype(dtype) if dtype else None,
        max_shard_bytes=max_shard_bytes, overwrite=overwrite, progress=progress, direct_io=direct_io,
        sources=(opened.path,), trainer=dict(opened.trainer or {}), hyper=dict(opened.hyper or {}),
        extra=dict(layout),
    )  # fmt: skip
    done = importlib.import_module(TORCH_TARGETS[to]).write_request(request)
    return ExportSummary(opened.format, os.path.abspath(out), done.files, done.tensors, done.nbytes,
                         time.perf_counter() - t0, optimizer, tuple(opened.notes) + done.notes)  # fmt: skip
