"""Our own checkpoints: the Orbax store, read one way (lazily), written streaming.

- `manager.CheckpointStore`: Orbax CheckpointManager with items `params`, `opt_state`,
  `trainer_state` (save interval, keep-N, keep-best, async, optimizer optional; restore onto any
  mesh with a topology report).
- `save.save_checkpoint`: one step written atomically (temporary sibling, then rename); leaves may
  be `stream.LazyLeaf`s, written tile by tile (`stream`).
- Orbax's files below the Orbax API (the codec, raw chunk files, the chunk index, the lazy
  reader, the declared-size bounds, the item keys) are `hybridckpt.containers.orbax`; our store
  read as a source is the format `hybridckpt.formats.orbax_store`; `hybridckpt.restore` (a
  checkpoint onto a mesh in one call) is `hybridckpt.jobs.restore`.
This package's names load on first use (no JAX until one is asked for).
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
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
