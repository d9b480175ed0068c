"""Paddle FlexCheckpoint folders (format "flex-checkpoint"), read without paddle.

FlexCheckpoint is Paddle's distributed checkpoint (`paddle.distributed.save_state_dict` /
`load_state_dict`, PaddlePaddle/Paddle: python/paddle/distributed/flex_checkpoint/), and the
default checkpoint of the PaddleFormers 1.x Trainer (`save_checkpoint_format="flex_checkpoint"`).
A FlexCheckpoint folder is `{id}.metadata` (the pickled `Metadata` dataclass: every stored block
of every tensor with its global offset, shape, dtype and, for sharding stage1 v2 / stage3, its
flattened range) plus one `{rank}_{id}.distcp` data file per rank (a `paddle.save` pickle of the
rank's blocks, or a safetensors file). A PaddleFormers `checkpoint-N/` holds three of them:
`model_state/`, `optimizer_state/`, `master_weight/`; an output folder of several is read at its
latest (`steps`; `--step` picks another).

Modules:
- `folders`   `detect`, `steps`: which folders are FlexCheckpoint folders, by file names.
- `metadata`  the `.metadata` pickle (stubbed classes, checked fields) -> `Block`s.
- `storage`   the `.distcp` files; global tensors assembled lazily from plain and flattened
              blocks (a box reads only the byte ranges it needs).
- `reader`    `open`: the three folders -> params, Adam moments, masters, the step
              from the beta pows, trainer state; HF names via the family's flex_checkpoint
              dialect (`reader.hf_rules`).
- `aoa_syntax` AOA config files and statements (tokens, names, attributes, macro tags).
- `aoa`       Paddle's AOA key-mapping statements translated into hybridckpt's rules language
              (`--rules FILE.aoa`: one rule set per statement, applied in order), and their
              reverse.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridckpt.formats.flex_checkpoint.folders import detect, steps

# the reader (the pickle machine, Paddle's optimizer names) is imported on first use: `detect`
# imports `folders` only (formats.registry tries it before DCP)
_WHERE = {"NAME": "reader", "open": "reader"}

__all__ = ["NAME", "detect", "open", "steps"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
