"""One export to a torch trainer's checkpoint (`--to dcp|torchtitan|megatron`), as its writer sees it.

Each of those writers (`formats.dcp.write`, `formats.dcp.write_torchtitan`, `formats.megatron_dist.write`) keeps
`write_export(job, **options)` over a `TorchExport` and exposes `write_request(request)`: its
format's `write` in `formats.registry.FORMATS` ("hybridckpt.formats.dcp.write:write_request"). `request` is a
`writers.ExportRequest`: `named` the checkpoint under HF names with its slots and step, `config`
the model config, `optimizer`, `dtype` (params cast on write; the fp32 values still go to the
targets that keep masters as `masters`), `options` the target's own options (`files`, `tp`, `pp`).
`run` turns it into a `TorchExport` and the writer's call and returns a `writers.Written` (with
the writer's notes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridckpt.errors import CheckpointError
from hybridckpt.formats.dcp.write_files import DEFAULT_CHUNK_BYTES, Item, write_folder
from hybridckpt.lazy import LazyTensor
from hybridckpt.lazy.dtypes import cast_floating
from hybridckpt.writers.destination import Destination


@dataclass(frozen=True)
class TorchExport:
    """What a torch writer writes: HF-named `params` (cast to the requested dtype) of model config
    `cfg` at `out`; with `slots` (AdamW's moments by slot name, then param name; None: weights
    only) the `step`, the source's `hyper` (lr, betas, ...) and `optimizer_name`; `masters` the
    uncast params (fp32 masters for targets that keep them); `trainer` the source's trainer
    metadata. `max_chunk_bytes`, `direct_io`, `on_tensor` go to `dcp_files.write_folder`;
    `overwrite` and `sources` to the `Destination`."""

    out: str
    params: Mapping[str, LazyTensor]
    cfg: Any
    slots: Mapping[str, Mapping[str, LazyTensor]] | None = None
    step: int | None = None
    hyper: Mapping[str, Any] = field(default_factory=dict)
    optimizer_name: str | None = None
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    direct_io: bool = True
    overwrite: bool = False
    sources: tuple[str, ...] = ()
    on_tensor: Callable[[str, int], None] | None = None
    trainer: Mapping[str, Any] = field(default_factory=dict)
    masters: Mapping[str, LazyTensor] | None = None

    def check_adamw(self, target: str) -> None:
        """Refuse `--optimizer` for a source whose optimizer is not AdamW (the torch targets keep
        AdamW's state): one line naming `target` (e.g. "export --to dcp") and the optimizer."""
        if self.slots and self.optimizer_name not in (None, "adamw"):
            raise CheckpointError(f"{target} --optimizer writes torch AdamW's state; this checkpoint's optimizer "
                                  f"is {self.optimizer_name}")  # fmt: skip

    def destination(self) -> Destination:
        """The atomic destination folder for `out` (written aside, swapped in on commit)."""
        return Destination(self.out, overwrite=self.overwrite, sources=self.sources, marker=True)

    def write_items(self, folder: str, items: Sequence[Item], *, files: int, checkpoint_id: str, **options: Any) -> list[str]:
        """`dcp_files.write_folder` of `items` into `folder` with this export's chunking, IO and
        progress; `options` are write_folder's own (`planner`, `id_as_path`)."""
        return write_folder(folder, items, files=files, max_chunk_bytes=self.max_chunk_bytes, direct_io=self.direct_io,
                            checkpoint_id=checkpoint_id, on_tensor=self.on_tensor, **options)  # fmt: skip


def run(request: Any, write_export: Callable[..., tuple[list[str], list[str]]]) -> Any:
    """Call a torch writer's `write_export` for `request` (module doc)."""
    from hybridckpt.writers import preflight

    preflight(request)
    named = request.named
    params = dict(named.params)
    params, _ = cast_floating(params, request.dtype)  # (None: every tensor as stored)
    slots = {s: dict(t) for s, t in named.slots.items()} if request.optimizer else None
    every = list(params.values()) + [t for v in (slots or {}).values() for t in v.values()]
    set_total = getattr(request.progress, "set_total", None)
    if set_total is not None:
        set_total(sum(t.nbytes for t in every))
    job = TorchExport(
        request.out, params, request.config, slots=slots, step=named.step, hyper=dict(request.hyper or {}),
        optimizer_name=named.optimizer.name if slots else None, direct_io=request.direct_io,
        overwrite=request.overwrite, sources=tuple(request.sources), on_tensor=request.progress,
        trainer=dict(request.trainer or {}), masters=dict(named.params),
        **({"max_chunk_bytes": request.max_shard_bytes} if request.max_shard_bytes else {}),
    )  # fmt: skip
    files, notes = write_export(job, **dict(request.options or {}))
    from hybridckpt.writers import Written, cast_notes

    return Written(tuple(files), len(every), sum(t.nbytes for t in every), (*notes, *cast_notes(request)))
