"""What every format's writer is asked and answers, and the one destination helper they all use.

A writer (`write` of a format in `formats.registry.FORMATS`) takes an `ExportRequest` (the
checkpoint under HF names with its optimizer slots and step, the model config, the options) and
returns a `Written` (files, tensors, bytes). Every writer writes through
`writers.destination.Destination`: checked against the sources, locked, written aside, swapped in
(`writers.ownership`: what may be replaced).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ExportRequest:
    """What a writer is asked to write.

    out: the folder to create; named: `naming.Named` under HF names (the model's tensors when
    `config` is set, else the source's own names), with its slots and step; optimizer: write the
    slots and step too; dtype: cast the floating params on write (a numpy dtype, or a `--dtype`
    name made one: `lazy.dtypes.np_dtype`) or None; trainer: the source's
    trainer metadata (e.g. `adam_betas`); hyper: the optimizer's hyper-parameters with its param
    groups under the exported names ({} when unknown or not exported); sources: paths the output
    must not be, hold or lie in; files: the config, generation config and tokenizer files that
    travel with the source (name -> `io.model_files.ModelFile`);
    options: the writer's own options, those its `formats.registry.Format.options` names (`--to
    dcp|torchtitan`: `files`, the writer files; `--to megatron`: `tp`, `pp`; `--to maxtext`:
    `scan_layers`); `formats.registry.write` refuses any other."""

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
    options: Mapping[str, Any] = field(default_factory=dict)


    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            from hybridckpt.lazy.dtypes import np_dtype

            object.__setattr__(self, "dtype", np_dtype(self.dtype))


@dataclass(frozen=True)
class Written:
    """What a writer wrote: file names (in the folder), tensors and their bytes, remarks for the
    user (e.g. the flags a trainer resumes with)."""

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    notes: tuple[str, ...] = ()


def cast_notes(request: ExportRequest) -> tuple[str, ...]:
    """A writer's note on what `request.dtype` casts of its params (`lazy.dtypes.cast_floating`,
    the helper every writer casts with), or () when nothing is cast."""
    from hybridckpt.lazy.dtypes import cast_floating

    note = cast_floating(request.named.params, request.dtype)[1].note()
    return (note,) if note else ()


def preflight(request: ExportRequest) -> None:
    """The destination's checks (`writers.destination.Destination.preflight`: not a source, not a
    home, nothing there we did not write unless replaceable), made by every writer first, before
    it reads a byte."""
    from hybridckpt.writers.destination import Destination

    Destination(request.out, overwrite=request.overwrite, sources=list(request.sources)).preflight()
