"""Our own checkpoints: the Orbax store, read one way (lazily), written streaming.

- `manager.CheckpointStore`: Orbax CheckpointManager with items `params`, `opt_state`,
  `trainer_state` (save interval, keep-N, keep-best, async, optimizer optional; restore onto any
  mesh with a topology report).
- `save.save_checkpoint`: one step written atomically (temporary sibling, then rename); leaves may
  be `stream.LazyLeaf`s, written tile by tile (`stream`).
- `codec`: the arrays' zarr compressor of a streaming save (`--compression`; raw by default).
- `chunk_files`: raw chunks written as plain files, one per chunk (a raw import's items are saved
  without OCDBT; compressed ones and training-loop saves use OCDBT, Orbax's default).
- `chunk_index`: where each stored chunk lies in the item's files (the OCDBT index, or the
  folder of each array).
- `reader`: any array of a saved item as a lazy tensor (a box read reads only its chunks; raw
  chunks by pread, or copied file to file by an export).
- `restore.restore`: a checkpoint onto a mesh in one call, with its optimizer state.
- `source`: our checkpoint as a source for every job (HF-named lazy tensors + optimizer slots);
  its `detect` needs no JAX, so this package's names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CheckpointStore": "manager",
    "Restored": "layout",
    "TopologyChange": "layout",
    "rng_from_json": "layout",
    "rng_to_json": "layout",
    "latest_step": "orbax_io",
    "list_steps": "orbax_io",
    "load_params_metadata": "orbax_io",
    "read_trainer_state": "orbax_io",
    "save_checkpoint": "save",
    "restore": "restore",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
