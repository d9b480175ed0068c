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

from hybridckpt.formats.lightning.reader import NAME, detect, open, steps  # noqa: A004 - the format contract

__all__ = ["NAME", "detect", "open", "steps"]
