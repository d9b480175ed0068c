"""Writers: every layout an export can produce, and the one destination helper they all use.

`WRITERS` lists (name, "module:function") in the order `--to` offers them; each function takes
an `ExportRequest` (the checkpoint under HF names with its optimizer slots and step, the model
config, the options) and returns an `Written` (files, tensors, bytes). `write(to, request)` picks
one. Every writer writes through `writers.destination.Destination`: checked against the sources,
locked, written aside, swapped in. A new layout is one module here and one line in `WRITERS`
(the CLI's `--to` choices come from `NAMES`, without importing any writer).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridckpt.errors import ConfigError

# (the `--to` name, "module:function"), the first the default
WRITERS: tuple[tuple[str, str], ...] = (
    ("hf", "hybridckpt.writers.hf_folder:write_export"),
    ("paddlenlp-unified", "hybridckpt.writers.paddle_unified:write_export"),
    ("paddleformers-unified", "hybridckpt.writers.paddle_unified:write_export"),
    ("dcp", "hybridckpt.writers.torch_dcp:write_request"),
    ("torchtitan", "hybridckpt.writers.torchtitan:write_request"),
    ("megatron", "hybridckpt.writers.megatron_dist:write_request"),
    ("maxtext", "hybridckpt.writers.maxtext:write_export"),
)
NAMES: tuple[str, ...] = tuple(name for name, _ in WRITERS)


@dataclass(frozen=True)
class ExportRequest:
    """What a writer is asked to write.

    out: the folder to create; named: `naming.Named` under HF names (the model's tensors when
    `config` is set, else the source's own names), with its slots and step; optimizer: write the
    slots and step too; dtype: cast params on write (numpy dtype) or None; trainer: the source's
    trainer metadata (e.g. `adam_betas`); hyper: the optimizer's hyper-parameters with its param
    groups under the exported names ({} when unknown or not exported); sources: paths the output
    must not be, hold or lie in; files: the config, generation config and tokenizer files that
    travel with the source (name -> `io.model_files.ModelFile`);
    extra: writer-specific options (`--to dcp|torchtitan`: `files`, the writer files; `--to megatron`:
    `tp`, `pp`)."""

    layout: str
    out: str
    named: Any
    config: Any = None
    optimizer: bool = False
    dtype: Any = None
    max_shard_bytes: int | None = None
    overwrite: bool = False
    progress: Callable[[str, int], None] | None = None
    direct_io: bool = True
    sources: tuple[str, ...] = ()
    source_format: str = ""
    trainer: Mapping[str, Any] = field(default_factory=dict)
    hyper: Mapping[str, Any] = field(default_factory=dict)  # optimizer hyper-parameters, exported names
    files: Mapping[str, Any] = field(default_factory=dict)  # carried config/tokenizer files (io.model_files)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Written:
    """What a writer wrote: file names (in the folder), tensors and their bytes, remarks for the
    user (e.g. the flags a trainer resumes with)."""

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    notes: tuple[str, ...] = ()


def write(request: ExportRequest) -> Written:
    """Write `request` with the writer its `layout` names."""
    where = dict(WRITERS).get(request.layout)
    if where is None:
        raise ConfigError(f"--to {request.layout!r}: expected one of {', '.join(NAMES)}")
    module, _, function = where.partition(":")
    return getattr(importlib.import_module(module), function)(request)
