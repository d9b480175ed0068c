"""Write the single-card HF layout: `model*.safetensors` (+ index), `config.json`, and optionally
`optimizer*.safetensors` with one tensor per parameter and optimizer slot, `<name>.<slot>` (AdamW:
`<hf name>.exp_avg`, `<hf name>.exp_avg_sq`), and a 0-d int64 `step`.

Everything is written into a temporary sibling of the destination and renamed into place when
complete (`writers.destination`: checked against the sources, locked against a second job), so a
failed or killed export leaves no folder that looks complete. Tensors are read and written one at
a time: peak memory is the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from hybridckpt.containers import safetensors_file as sf
from hybridckpt.errors import CheckpointError, ConfigError
from hybridckpt.io import model_files
from hybridckpt.io.model_files import CONFIG, ModelFile
from hybridckpt.lazy import ArrayTensor, LazyTensor
from hybridckpt.lazy.dtypes import cast_floating
from hybridckpt.writers.destination import Destination

DEFAULT_SHARD_BYTES = 5 * 1024**3
RESERVED = "__metadata__"  # a safetensors header's metadata: no tensor can be named so


def write_sharded(
    folder: str,
    tensors: Mapping[str, LazyTensor],
    *,
    stem: str,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    on_tensor: Callable[[str, int], None] | None = None,
    direct_io: bool = True,
) -> list[str]:
    """Write `stem.safetensors`, or `stem-0000i-of-0000N.safetensors` + `stem.safetensors.index.json`
    when the tensors exceed `max_shard_bytes` (`direct_io`: see `safetensors_file.write`). Returns
    the file names."""
    names = sorted(tensors)
    shards = sf.plan_shards(((n, tensors[n].nbytes) for n in names), max_shard_bytes)
    if len(shards) <= 1:
        sf.write(os.path.join(folder, f"{stem}.safetensors"), tensors, {"format": "pt"}, on_tensor=on_tensor,
                 direct_io=direct_io)
        return [f"{stem}.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        sf.write(os.path.join(folder, fname), {n: tensors[n] for n in shard}, {"format": "pt"}, on_tensor=on_tensor,
                 direct_io=direct_io)
        files.append(fname)
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": sum(tensors[n].nbytes for n in names)}, "weight_map": weight_map}
    with open(os.path.join(folder, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return files + [f"{stem}.safetensors.index.json"]


def write_hf(
    dst: str,
    params: Mapping[str, LazyTensor],
    hf_config: Mapping | None,
    *,
    slots: Mapping[str, Mapping[str, LazyTensor]] | None = None,
    step: int | None = None,
    with_step: bool = True,
    trainer: Mapping | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
    direct_io: bool = True,
    sources: Iterable[str] = (),
    files: Mapping[str, bytes | ModelFile] | None = None,
    more: Callable[[str], list[str]] | None = None,
) -> list[str]:
    """Write an HF folder at `dst` atomically (never at or around one of `sources`).

    params: name -> tensor (`model*.safetensors`); hf_config: the `config.json` dict, or None for a
    model-agnostic consolidation (no config.json); slots: optimizer slot -> name -> tensor, written
    to `optimizer*.safetensors` as `<name>.<slot>` with the 0-d int64 `step` (unless `with_step` is
    False: an optimizer that keeps no step, e.g. SGD); trainer: written to
    `hybridckpt.json`. direct_io: the safetensors files written with O_DIRECT
    (`io.sequential_file`; False: through the page cache). files: more files by plain name
    (`io.model_files`: config, generation config, tokenizer), bytes or a carried file to copy
    (read and checked); a `config.json` among them is written unless `hf_config` is given.
    more: writes further files into the temporary folder it is given, returns their names (the
    Trainer's resume files: `formats.trainer.write`).
    """
    files_in = files
    if RESERVED in params:  # (the optimizer's `<name>.<slot>` and `step` cannot be it)
        raise CheckpointError(f"export --to hf: a tensor named {RESERVED!r} cannot be stored in safetensors (the "
                              f"header's own key for its metadata); rename it (--rules)")
    dest = Destination(dst, overwrite=overwrite, sources=sources, marker=True)
    with dest as tmp:
        files = write_sharded(tmp, params, stem="model", max_shard_bytes=max_shard_bytes, on_tensor=on_tensor,
                              direct_io=direct_io)
        if hf_config is not None:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(dict(hf_config), f, indent=2, sort_keys=True)
            files.append("config.json")
        for name, content in sorted((files_in or {}).items()):
            if name == CONFIG and hf_config is not None:
                continue
            data = content.read() if isinstance(content, ModelFile) else content
            with open(os.path.join(tmp, model_files.plain(name)), "wb") as f:
                f.write(data)
            files.append(name)
        if slots:
            state: dict[str, LazyTensor] = {}
            for slot, tensors in slots.items():
                state |= {f"{k}.{slot}": v for k, v in tensors.items()}
            if with_step:
                state["step"] = ArrayTensor(np.asarray(step or 0, dtype=np.int64))
            files += write_sharded(tmp, state, stem="optimizer", max_shard_bytes=max_shard_bytes,
                                   on_tensor=on_tensor, direct_io=direct_io)
        if more is not None:
            files += more(tmp)
        if trainer:
            with open(os.path.join(tmp, "hybridckpt.json"), "w") as f:
                json.dump(dict(trainer), f, indent=2, sort_keys=True, default=str)
            files.append("hybridckpt.json")
        dest.commit()
    return files


def source_config_json(trainer: Mapping | None) -> dict | None:
    """The source's own `config.json` object, for an export without a model config: the HF reader
    keeps it (trainer `"hf_config"`, `quantization_config` removed) for an architecture no family
    implements, and an import carries it in its trainer state; None when there is none."""
    raw = (trainer or {}).get("hf_config")
    return dict(raw) if isinstance(raw, Mapping) else None


def write_export(request) -> Any:
    """The hf format's writer: the request's params (cast to its dtype) as `model*.safetensors`
    with the model's `config.json`, its slots and step as `optimizer*.safetensors` when asked.

    Read ahead in the order `write_hf` writes (model tensors by name, then optimizer tensors by
    `<name>.<slot>`) by the reader pool (`lazy.parallel.Prefetcher`), within a window of the
    largest tensor staged; tensors copied file to file, or read and written in row blocks (over
    `WRITE_BLOCK_BYTES`), are not read ahead."""
    from hybridckpt import lazy
    from hybridckpt.containers.safetensors_file import WRITE_BLOCK_BYTES
    from hybridckpt.lazy import parallel
    from hybridckpt.writers import Written, cast_notes, preflight

    preflight(request)
    named, cfg = request.named, request.config
    params = dict(named.params)
    params, _ = cast_floating(params, request.dtype)  # (None: every tensor as stored)
    slots = {s: dict(t) for s, t in named.slots.items()} if request.optimizer else {}
    more, notes, hooked = None, (), []
    if slots and request.options.get("optimizer_layout", "safetensors") == "trainer":  # formats/trainer/write.py
        from hybridckpt.formats.trainer.write import hf_hook

        more, notes, hooked = hf_hook(request, params, slots)
        slots = {}  # (written by the hook, read as it writes them: not read ahead)
    staged: dict[tuple[str, str], LazyTensor] = {("model", k): v for k, v in params.items()}
    for slot, tensors in slots.items():
        staged |= {("optimizer", f"{k}.{slot}"): v for k, v in tensors.items()}
    every = list(staged.values()) + hooked
    staged = {k: v for k, v in staged.items() if v.nbytes <= WRITE_BLOCK_BYTES and lazy.copy_runs(v) is None}
    order = sorted(k for k in staged if k[0] == "model") + sorted(k for k in staged if k[0] == "optimizer")
    window = max((t.nbytes for t in staged.values()), default=0)
    ahead = parallel.Prefetcher(staged, order, window).tensors()
    params = {k: ahead.get(("model", k), v) for k, v in params.items()}
    slots = {s: {k: ahead.get(("optimizer", f"{k}.{s}"), v) for k, v in t.items()} for s, t in slots.items()}
    set_total = getattr(request.progress, "set_total", None)
    if set_total is not None:
        set_total(sum(t.nbytes for t in every))
    from hybridckpt.formats.hf.files import export_files

    # config.json, generation_config.json, tokenizer files (formats/hf/files.py)
    beside = export_files(cfg, request.files, params, source_config=source_config_json(request.trainer))
    trainer = {"step": named.step, "source_format": request.source_format}
    if slots or more:
        trainer["optimizer_name"] = named.optimizer.name
        if request.hyper:  # read back by the hf reader as the hyper-parameters (formats/hf.py)
            trainer["optimizer"] = dict(request.hyper)
    files = write_hf(
        request.out, params, None, files=beside, slots=slots or None, step=named.step,
        with_step=bool(slots) and named.optimizer.has_step, trainer=trainer,
        max_shard_bytes=request.max_shard_bytes or DEFAULT_SHARD_BYTES, overwrite=request.overwrite,
        on_tensor=request.progress, direct_io=request.direct_io, sources=request.sources, more=more,
    )
    return Written(tuple(files), len(every), sum(t.nbytes for t in every), (*cast_notes(request), *notes))


def check_options(options, optimizer: bool) -> None:
    """The hf writer's options, before anything is read: `optimizer_layout` ("safetensors" or
    "trainer": `formats.trainer.write`) only with the optimizer asked for."""
    layout = options.get("optimizer_layout")
    if layout is None:
        return
    from hybridckpt.formats.trainer.write import LAYOUTS

    if layout not in LAYOUTS:
        raise ConfigError(f"--optimizer-layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if not optimizer:
        raise ConfigError(f"--optimizer-layout {layout}: only with --optimizer (it says how the optimizer state is written)")
