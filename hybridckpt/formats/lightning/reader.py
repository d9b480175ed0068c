"""`open`: a Lightning checkpoint as HF-named lazy tensors, its optimizer and trainer state.

- A `.ckpt` FILE: the `state_dict`'s tensors (through the torch-file reader's checks,
  `hf_bin.tensors_of`), the LightningModule's attribute prefix cut (`prefix`), the index-keyed
  `optimizer_states[0]` handed over as `SourceCheckpoint.index_optimizer` (`state`; one keyed by
  name, as `FSDPStrategy(state_dict_type="full")` saves it, is read by name, the prefix cut), the
  step from `global_step`.
- A sharded `.ckpt/` FOLDER: the DCP reader's tensors, moments and param groups (all by name,
  after the DCP's `model.` / `optimizer_0.` keys), the same prefix cut from all three, the step
  from `meta.pt`'s `global_step` (the optimizer's own step kept by the optimizer).
- A folder of several: its latest `*step=N*.ckpt` (`files.steps`; `--step` picks another).
The model config: `--config`, else a `config.json` beside the checkpoint or in the folder above
it (Lightning writes none; a training script saves one next to its checkpoints).
`global_step`, `epoch`, the Lightning version and `lr_schedulers` go to trainer metadata.
"""

from __future__ import annotations

import os
from dataclasses import replace

from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.errors import FormatError, short_repr
from hybridckpt.formats import dcp
from hybridckpt.formats.hf import bin as hf_bin
from hybridckpt.formats.lightning import files, prefix, state
from hybridckpt.io.config_file import config_beside, read_json
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "lightning"
detect = files.detect
steps = files.steps


def _config(path: str, config) -> tuple[object, dict]:
    """(the model config or None, trainer entries): `--config`, else the first `config.json`
    beside the checkpoint or in the folder above; one of an architecture no family implements
    is kept as `hf_config` (the checkpoint is then read under its own names)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    folders = (folder, os.path.dirname(folder))
    cfg = config_beside(*folders, config=config)
    if cfg is not None or config is not None:
        return cfg, {}
    for f in folders:
        if os.path.isfile(os.path.join(f, "config.json")):
            return None, {"hf_config": read_json(os.path.join(f, "config.json"))}
    return None, {}


def _unknown(raw: dict) -> list[str]:
    if "hf_config" not in raw:
        return []
    from hybridckpt.formats.hf import architecture

    return [f"{architecture(raw['hf_config'])}: no model family implements it; read under its own names"]


def _name_step(path: str, trainer: dict) -> list[str]:
    """A note when the checkpoint's name (`step=N`) and its `global_step` differ."""
    named = files.CkptNames().number(os.path.basename(path))
    step = trainer.get("global_step")
    if named is None or step is None or named == step:
        return []
    return [f"{os.path.basename(path)}: the name says step {named}, its global_step {step} (the step read)"]


def _prefix(names: list[str], cfg, where: str) -> prefix.Prefix:
    if cfg is None:
        return prefix.choose(names, None, where)
    from hybridckpt import models

    return prefix.choose(names, prefix.family_fit(cfg), where, models.family_of(cfg).name)


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    path = os.path.abspath(path)
    found = files.steps(path)
    if found is not None:
        src = open(found.folder(found.default), config=config)
        return replace(src, notes=(f"Lightning checkpoint folder: {found.note(found.default)}", *src.notes))
    if files.is_sharded_folder(path):
        return _open_sharded(path, config)
    if os.path.isfile(path):
        return _open_file(path, config)
    raise FormatError(f"{path}: not a Lightning checkpoint (expected a .ckpt file, a sharded .ckpt/ folder with "
                      f"{files.META}, or a folder of *step=N*.ckpt)")


def _open_file(path: str, config) -> SourceCheckpoint:
    obj = files.load_dict(path, "a Lightning checkpoint")
    if not files.looks_lightning(obj):
        raise FormatError(f"{path}: expected a Lightning checkpoint dict ({files.STATE!r} and one of "
                          f"{', '.join(map(repr, files.MARKS))}), found keys {short_repr(list(obj)[:8])}")
    tensors = hf_bin.tensors_of(obj[files.STATE], f"{path}: [{files.STATE!r}]")
    cfg, raw = _config(path, config)
    chosen = _prefix(list(tensors), cfg, path)
    tensors = prefix.strip_mapping(tensors, chosen.prefix, path, "tensor")
    index_opt, opt, notes = state.optimizer_of(obj, path)
    if opt is not None:
        opt = _stripped_optimizer(opt, chosen.prefix, path)
    ties = hf_bin.tied_copies(tensors)
    notes += [f"{k} is a view of {v}'s storage (a tied copy, read once)" for k, v in ties.items()]
    trainer = {**raw, **state.trainer_of(obj, path)}
    notes += _name_step(path, trainer) + _unknown(raw)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=opt,
        config=cfg,
        step=trainer.get("global_step"),
        trainer={"lightning_layout": "file", "attribute_prefix": chosen.prefix, **trainer},
        notes=(chosen.note, *notes),
        index_optimizer=index_opt,
    )


def _open_sharded(path: str, config) -> SourceCheckpoint:
    meta_path = os.path.join(path, files.META)
    meta = files.load_dict(meta_path, "Lightning's state beside the shards")
    trainer = state.trainer_of(meta, meta_path)
    optimizers = sorted({k.split(".", 1)[0] for k in read_metadata(path).tensors if k.startswith("optimizer_")})
    if len(optimizers) > 1:
        raise FormatError(f"{path}: the state of {len(optimizers)} optimizers ({', '.join(optimizers[:4])}): each "
                          f"holds its own parameters' state; one optimizer's state is what an import carries (--format dcp "
                          f"reads the folder under its own names)")
    cfg, raw = _config(path, config)
    src = dcp.open(path, config=cfg)
    chosen = _prefix(list(src.tensors), cfg, path)
    tensors = prefix.strip_mapping(src.tensors, chosen.prefix, path, "tensor")
    notes = [chosen.note, *_name_step(path, trainer), *_unknown(raw)]
    trainer = {**raw, **trainer}
    opt = src.optimizer
    if opt is not None:
        opt = _stripped_optimizer(opt, chosen.prefix, path)
        if trainer.get("global_step") is not None and opt.step is not None and opt.step != trainer["global_step"]:
            notes.append(f"{files.META} says global_step {trainer['global_step']}, the optimizer state step "
                         f"{opt.step} (kept for the optimizer)")
    step = trainer.get("global_step", src.step)
    return replace(
        src,
        format=NAME,
        tensors=tensors,
        optimizer=opt,
        config=cfg,
        step=step,
        trainer={**src.trainer, "lightning_layout": "sharded", "attribute_prefix": chosen.prefix, **trainer},
        notes=(*notes, *src.notes),
    )


def _stripped_optimizer(opt: OptimizerState, pre: str, where: str) -> OptimizerState:
    """`opt` (the DCP reader's, by LightningModule name) under the names with `pre` cut: every
    slot's and every param group's."""
    slots = {s: prefix.strip_mapping(t, pre, where, f"optimizer state ({s}) of") for s, t in opt.slots.items()}
    hyper = dict(opt.hyper)
    if hyper.get("groups"):
        hyper["groups"] = [
            {**g, "params": list(prefix.strip_mapping(dict.fromkeys(g.get("params") or []), pre, where,
                                                      "param group entry"))}
            for g in hyper["groups"]
        ]
    master = prefix.strip_mapping(opt.master, pre, where, "master weight") if opt.master else opt.master
    return replace(opt, slots=slots, hyper=hyper, master=master)
