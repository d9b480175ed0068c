"""transformers Trainer / accelerate checkpoint folders, read without torch, transformers or
accelerate: a layer over the readers of the weights and optimizer files they hold.

Layouts (`folder`): FSDP1/FSDP2 `SHARDED_STATE_DICT` (`pytorch_model_fsdp_K/`, `optimizer_K/`:
DCP folders), `FULL_STATE_DICT` (`pytorch_model_fsdp_K.bin` or `model.safetensors`, and
`optimizer_K.bin`), the DeepSpeed variant (`latest`, `global_stepN/`: the DeepSpeed reader),
and plain folders (`model.safetensors` + `optimizer.pt` / accelerate's `optimizer.bin`). The
trainer layer (`reader`) adds the step of `trainer_state.json`, the scheduler's learning rate,
the optimizer's hyper-parameters, and the model config from `--config`, the folder or the
output folder above it (which one, said). An output folder reads its latest `checkpoint-N` (`steps`;
`--step` picks another).

Modules: `folder` (which files, trainer_state / scheduler / training_args; `detect`, `steps`), `fsdp`
(model and optimizer files as tensors and slots), `reader` (`open`).
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridckpt.formats.trainer.folder import detect, steps

# the reader (the FSDP, DeepSpeed and HF weights readers) is imported on first use: `detect`
# imports `folder` only (formats.registry tries it before DCP)
_WHERE = {"NAME": "reader", "open": "reader"}

__all__ = ["NAME", "detect", "open", "steps"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
