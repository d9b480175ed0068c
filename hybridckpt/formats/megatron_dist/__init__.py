"""Megatron-Core distributed checkpoints (`--ckpt-format torch_dist`): Megatron-LM, NeMo 2, Megatron-Bridge.

The default checkpoint format of current Megatron-LM, NeMo 2 and Megatron-Bridge, written by
`megatron.core.dist_checkpointing.save(sharded_state_dict, dir)` (NVIDIA/Megatron-LM:
megatron/core/dist_checkpointing/serialization.py). Read here without torch or megatron:

- Folder (`layout`): `<save>/latest_checkpointed_iteration.txt`, `iter_{N:07d}/` (or NeMo 2's
  `weights/` beside `context/`) holding torch DCP files (`.metadata`, `__{rank}_{n}.distcp`) and
  `metadata.json` = `{"sharded_backend": "torch_dist", ...}`, written last: without it the save
  is unfinished (a one-line error). Detected BEFORE plain DCP, which would claim the folder.
- Container: a DCP checkpoint whose keys are GLOBAL ShardedTensor keys, every chunk a `torch.save`
  archive at its global offsets (`hybridckpt.containers.dcp_metadata`, `formats.dcp`); megatron-core
  0.15's `MCoreMetadata` pickle is accepted. ShardedObjects are byte items
  `<key>/shard_<offsets>_<shape>` holding `torch.save([data])`.
- Common state (`common`): `common.pt` (older) or the `common_state` object (core 0.19): `args`,
  `iteration`, `checkpoint_version`, `content_metadata`, the optimizer's param groups. Without
  `args` (Megatron-Bridge, NeMo 2) the model config is `run_config.yaml`'s `model:` or NeMo's
  `context/model.yaml` `config:` (`config`: TransformerConfig fields back to args), or `--config`;
  the parallel degrees then come from the optimizer's bucket keys and the embedding's chunks.
- Model (`model`): global names, padded vocab, TE norm names, SwiGLU fc1 as `[gate; up]`,
  stacked layer keys unstacked by `rules/megatron_dist_layers.rules` to the per-layer names the
  legacy reader produces, so the same `rules/megatron_<family>.rules` map them to HF names.
- Optimizer: `fully_reshardable`, the non-distributed optimizer and `fully_sharded_model_space`
  (`optimizer`: model-space keys), `dp_reshardable` (`buckets`: per-bucket 1-D tensors, the
  param-to-bucket map rebuilt), `chained_{i}.` prefixes; the step from the param groups.

Modules: `layout` (folders, detection, the finished-save check), `common` (common state,
ShardedObjects), `config` (Bridge / NeMo YAML model configs), `model` (model keys), `optimizer`
(model-space state, step), `buckets` (dp_reshardable, degrees from keys), `reader` (`open`).
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridckpt.formats.megatron_dist.layout import detect, locate, steps

# the reader is imported on first use: `detect` imports `layout` only (formats.registry tries it before DCP)
_WHERE = {"NAME": "reader", "open": "reader"}

__all__ = ["NAME", "detect", "locate", "open", "steps"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
