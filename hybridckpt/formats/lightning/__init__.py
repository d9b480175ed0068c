"""Lightning checkpoints: the `.ckpt` file of `Trainer.save_checkpoint` / `ModelCheckpoint`, and
the sharded `.ckpt/` folder of `FSDPStrategy(state_dict_type="sharded")`.

The file is a torch.save dict (`state_dict` under the LightningModule's attribute prefix,
`optimizer_states` keyed by parameter index, `lr_schedulers`, `global_step`, `epoch`, ...); the
folder is a torch DCP checkpoint of `{"model": state_dict, "optimizer_0": ...}` keyed by name,
with `meta.pt` (the rest of the dict) beside the shards. Both are read through the project's own
readers (the restricted torch.save unpickler, `formats.dcp`); this package adds what is
Lightning's: detection and step folders (`files`), the attribute prefix cut by matching the
model family's names (`prefix`), the step, schedulers and the index-keyed optimizer (`state`),
and `open` (`reader`).
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridckpt.formats.lightning.files import detect, steps

# the reader (its HF and optimizer parts) is imported on first use: `detect` imports `files` only
# (formats.registry tries it before DCP)
_WHERE = {"NAME": "reader", "open": "reader"}

__all__ = ["NAME", "detect", "open", "steps"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
