"""One export request handed to a torch trainer's writer (`--to dcp|torchtitan|megatron`).

Each of those writers (`writers.torch_dcp`, `writers.torchtitan`, `writers.megatron_dist`) keeps
a keyword `write_export(out, params, cfg, *, slots, step, hyper, ...)` and exposes
`write_request(request)`: one entry of a writers registry ("dcp",
"hybridckpt.writers.torch_dcp:write_request"). `request` is any object with the fields of
`TorchRequest` (the export job's request): `named` the checkpoint under HF names with its slots
and step, `config` the model config, `optimizer`, `dtype` (params cast on write; the fp32
values still go to the targets that keep masters), `extra` the target's own options (`files`,
`tp`, `pp`, ...). `run` turns it into the writer's call and returns a `TorchWritten`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridckpt import lazy


@dataclass(frozen=True)
class TorchRequest:
    """The fields of an export request the torch writers read (names as the export job's)."""

    out: str
    named: Any
    config: Any = None
    optimizer: bool = False
    dtype: Any = None  # numpy dtype of the params on write, or None
    max_shard_bytes: int | None = None  # here: the largest DCP chunk (bytes)
    overwrite: bool = False
    progress: Callable[[str, int], None] | None = None
    direct_io: bool = True
    sources: tuple[str, ...] = ()
    trainer: Mapping[str, Any] = field(default_factory=dict)
    hyper: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TorchWritten:
    """What a torch writer wrote: file names (relative to `out`), tensors, their bytes, notes."""

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    notes: tuple[str, ...] = ()


def run(request: Any, write_export: Callable[..., tuple[list[str], list[str]]]) -> TorchWritten:
    """Call a torch writer's `write_export` for `request` (module doc)."""
    named = request.named
    params = dict(named.params)
    if request.dtype is not None:
        params = {k: lazy.cast(v, request.dtype) for k, v in params.items()}
    slots = {s: dict(t) for s, t in named.slots.items()} if request.optimizer else None
    every = list(params.values()) + [t for v in (slots or {}).values() for t in v.values()]
    set_total = getattr(request.progress, "set_total", None)
    if set_total is not None:
        set_total(sum(t.nbytes for t in every))
    options = dict(request.extra or {})
    if request.max_shard_bytes:
        options["max_chunk_bytes"] = request.max_shard_bytes
    files, notes = write_export(
        request.out, params, request.config, slots=slots, step=named.step, hyper=dict(request.hyper or {}),
        optimizer_name=named.optimizer.name if slots else None, direct_io=request.direct_io,
        overwrite=request.overwrite, sources=tuple(request.sources), on_tensor=request.progress,
        trainer=dict(request.trainer or {}), masters=dict(named.params), **options,
    )  # fmt: skip
    return TorchWritten(tuple(files), len(every), sum(t.nbytes for t in every), tuple(notes))
