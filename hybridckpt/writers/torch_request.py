"""One export request handed to a torch trainer's writer (`--to dcp|torchtitan|megatron`).

Each of those writers (`writers.torch_dcp`, `writers.torchtitan`, `writers.megatron_dist`) keeps
a keyword `write_export(out, params, cfg, *, slots, step, hyper, ...)` and exposes
`write_request(request)`: its entry in `writers.WRITERS` ("dcp",
"hybridckpt.writers.torch_dcp:write_request"). `request` is a `writers.ExportRequest`: `named` the checkpoint under HF names with its slots
and step, `config` the model config, `optimizer`, `dtype` (params cast on write; the fp32
values still go to the targets that keep masters), `extra` the target's own options (`files`,
`tp`, `pp`, ...). `run` turns it into the writer's call and returns a `writers.Written` (with the writer's notes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridckpt import lazy


def run(request: Any, write_export: Callable[..., tuple[list[str], list[str]]]) -> Any:
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
    from hybridckpt.writers import Written

    return Written(tuple(files), len(every), sum(t.nbytes for t in every), tuple(notes))
