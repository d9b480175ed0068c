"""Megatron-LM legacy (torch format) checkpoints: `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt`.

Layout (NVIDIA/Megatron-LM:megatron/training/checkpointing.py `get_checkpoint_name`,
`read_metadata`, `generate_state_dict`):
- `<save>/latest_checkpointed_iteration.txt`: an integer or `release`; the folder is
  `iter_{N:07d}` or `release`. `path` may be the save folder or the iteration folder.
- One folder per model-parallel rank: `mp_rank_{tp:02d}` (PP = 1) or
  `mp_rank_{tp:02d}_{pp:03d}`, `_{ep:03d}` appended when EP > 1 (so `mp_rank_00_001` is read
  with `args`). Every folder of the tp x pp grid must exist (DP rank 0 writes them).
- `model_optim_rng.pt`: `args` (argparse.Namespace), `checkpoint_version` (absent = 0),
  `iteration`, `model` or `model0`, `model1`, ... (one per virtual pipeline chunk),
  `optimizer`, `opt_param_scheduler`, `rng_state`, ...; `distrib_optim.pt` beside it with
  `--use-distributed-optimizer` (see `optimizer`).
- Model keys: mcore flat (`decoder.layers.{i}.self_attention.linear_qkv.weight`, ...; TE
  `*._extra_state` entries skipped) or legacy nested (`language_model.encoder....`, flattened
  with '.', renamed to mcore names by `rules/megatron_legacy.rules`). `layers.{i}` is the index
  inside the chunk: chunks are walked (vpp outer, pp inner) and each chunk's layer count added,
  which gives Megatron's `v*L/vp + p*L/(pp*vp)` offsets and also uneven stages.
- checkpoint_version < 2.0 stores qkv per rank as [3, np, hn] (0) or [np, hn, 3] (1.0):
  converted per rank by `rules/megatron_qkv_legacy.rules`; other versions below 2.0 are refused.
- TP shards merge by `rules/megatron_tp.rules`. A tied head's copy on the last PP stage
  (`word_embeddings_for_head.weight`, or mcore `output_layer.weight` when tied) is compared with
  the embedding on a sample of rows and dropped.

The tensors returned are mcore-named, global (layers numbered 0..L-1, TP merged, padded vocab);
`hf_rules` (the rules of the model family's megatron dialect, e.g.
`models/llama/dialects/megatron.rules`) maps them to HF names. Optimizer state: distributed optimizer
buffers or the torch optimizer state, merged the same way, as slots under torch's names.

Modules: `layout` (files, tracker, rank folders, parallel degrees), `model` (model chunks,
layer numbering, TP merge, the tied head's copy), `config` (args -> HF config and the
family's dialect), `optimizer` (one rank's optimizer state decoded), `reader` (`open`).
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridckpt.formats.megatron.layout import (
    MODEL_FILE,
    OPTIM_FILE,
    TRACKER,
    detect,
    iteration_dir,
    rank_folder,
    steps,
)

# the reader (the pickle machine, the model and optimizer decoding) is imported on first use: `detect`
# of any folder, this format's or not, imports `layout` only (formats.registry tries it before DCP)
_WHERE = {"NAME": "reader", "open": "reader", "model_config": "config"}

__all__ = [
    "MODEL_FILE",
    "NAME",
    "OPTIM_FILE",
    "TRACKER",
    "detect",
    "iteration_dir",
    "model_config",
    "open",
    "rank_folder",
    "steps",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
