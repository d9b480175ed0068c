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

import numpy as np

from hybridckpt.containers import safetensors_file as sf
from hybridckpt.io import model_files
from hybridckpt.io.model_files import CONFIG, ModelFile
from hybridckpt.lazy import ArrayTensor, LazyTensor
from hybridckpt.writers.destination import Destination

DEFAULT_SHARD_BYTES = 5 * 1024**3


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
    """
    files_in = files
    dest = Destination(dst, overwrite=overwrite, sources=sources)
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
        if trainer:
            with open(os.path.join(tmp, "hybridckpt.json"), "w") as f:
                json.dump(dict(trainer), f, indent=2, sort_keys=True, default=str)
            files.append("hybridckpt.json")
        dest.commit()
    return files
