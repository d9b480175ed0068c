"""A plain `torch.save` file of a state dict: `model.pt`, `*.pth`, `*.bin` by any name, or a
folder holding one such file (the checkpoint of a training script that called
`torch.save(model.state_dict(), path)`).

Layout (pytorch/pytorch torch/serialization.py; the container: `containers.pickle.torch_save`,
read through the restricted unpickler, no code runs, tensor bytes are byte ranges of the file):
- the zip archive (torch >= 1.6) or the legacy pickles (`_use_new_zipfile_serialization=False`),
  told apart from every other file by their first bytes (`torch_save.is_torch_zip`, `is_torch_legacy`);
- the object is a flat state dict `{name: tensor}` (`formats.hf.bin.tensors_of` checks it), or a
  dict holding one under `"model"`, `"state_dict"` or `"module"` (the common training-script
  wrappers `{"model": sd, "optimizer": ..., "epoch": ...}`): those tensors are read; beside them
  an optimizer state keyed by parameter index (torch's `opt.state_dict()` under one of
  `OPTIMIZER_KEYS`) is read as an `IndexKeyedOptimizer` (`formats.index_optim`, named in
  `jobs.open` from the model's `named_parameters()` order, one group or several in turn), the
  other entries named in a note and left alone.
Names are kept as the file has them. The model config: `--config`, else a `config.json` beside
the file in a folder given as the source (an architecture no family implements, or no config at
all: the tensors under their own names, as any model-agnostic source). `detect` reads a few bytes
of each file of a folder (at most `MAX_FILES` of them) and asks that exactly one is a torch file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hybridckpt import models
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError, UnknownModelError, short_repr
from hybridckpt.formats import index_optim
from hybridckpt.formats.hf import bin as hf_bin
from hybridckpt.io.config_file import read_json
from hybridckpt.source_checkpoint import IndexKeyedOptimizer, SourceCheckpoint

NAME = "torch"
WRAPPERS = ("model", "state_dict", "module")  # keys a training script saves its state dict under
MAX_FILES = 64  # a folder with more entries is not "a folder holding one torch file"
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt")  # where a loop saves opt.state_dict()


def is_torch_file(path: str) -> bool:
    """Whether `path` is a regular file that starts as a torch.save zip or legacy file does."""
    return os.path.isfile(path) and (torch_save.is_torch_zip(path) or torch_save.is_torch_legacy(path))


def _folder_file(folder: str) -> str | None:
    """The one torch file of `folder` (top level), or None when there is none or several."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    if len(names) > MAX_FILES:
        return None
    found = [n for n in names if is_torch_file(os.path.join(folder, n))]
    return os.path.join(folder, found[0]) if len(found) == 1 else None


def detect(path: str) -> bool:
    if os.path.isfile(path):
        return is_torch_file(path)
    return os.path.isdir(path) and _folder_file(path) is not None


def _weights(path: str) -> tuple[dict, list[str], IndexKeyedOptimizer | None]:
    """(the state dict's tensors, notes, an index-keyed optimizer state beside them or None) of
    the torch file `path`."""
    obj = torch_save.load(path)
    if isinstance(obj, Mapping) and not any(isinstance(v, Mapping) for v in obj.values()):
        return hf_bin.tensors_of(obj, path), [], None
    if isinstance(obj, Mapping):
        for key in WRAPPERS:
            if isinstance(obj.get(key), Mapping):
                opt_key = next((k for k in OPTIMIZER_KEYS if index_optim.is_index_keyed(obj.get(k))), None)
                by_index = None if opt_key is None else index_optim.read(obj[opt_key], f"{path} [{opt_key!r}]", "torch")
                others = [short_repr(k, 40) for k in obj if k not in (key, opt_key)]
                note = f"{os.path.basename(path)}: the state dict under {key!r}" + (
                    f"; its other entries are not read: {', '.join(others[:8])}" if others else "")
                return hf_bin.tensors_of(obj[key], f"{path}: [{key!r}]"), [note], by_index
        raise FormatError(f"{path}: expected a state dict (name -> tensor) or one under "
                          f"{' / '.join(map(repr, WRAPPERS))}, found a dict of {short_repr(list(obj)[:8])}")
    raise FormatError(f"{path}: expected a state dict (name -> tensor), found {type(obj).__name__}")


def _config(folder: str | None, config) -> tuple[object, dict | None]:
    """(the model config or None, the `config.json` object beside the file or None)."""
    path = None if folder is None else os.path.join(folder, "config.json")
    raw = read_json(path) if path is not None and os.path.isfile(path) else None
    if config is not None or raw is None:
        return config, raw
    try:
        return models.config_from_hf(raw, source=path), raw
    except UnknownModelError:
        return None, raw


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    file = path if os.path.isfile(path) else _folder_file(path)
    if file is None:
        raise FormatError(f"{path}: expected a torch.save file, or a folder holding exactly one")
    if not is_torch_file(file):
        raise FormatError(f"{file}: not a torch.save file (neither its zip archive nor the legacy format)")
    tensors, notes, by_index = _weights(file)
    if not tensors:
        raise FormatError(f"{file}: the state dict holds no tensors")
    cfg, raw = _config(path if os.path.isdir(path) else None, config)
    notes.append(f"a torch.save state dict: {os.path.basename(file)}")
    ties = hf_bin.tied_copies(tensors)
    notes += [f"{k} is a view of {v}'s storage (a tied copy, read once)" for k, v in ties.items()]
    trainer: dict = {}
    if cfg is None and raw is not None:
        from hybridckpt.formats.hf import architecture

        trainer["hf_config"] = raw
        notes.append(f"{architecture(raw)}: no model family implements it; read under its own names")
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=None,
        hf_rules=models.hf_name_fixes(cfg, tensors) if cfg is not None else "",
        config=cfg,
        step=None,
        trainer=trainer,
        notes=tuple(notes),
        index_optimizer=by_index,
    )
