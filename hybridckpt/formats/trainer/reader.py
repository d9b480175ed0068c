"""`open`: a transformers Trainer / accelerate checkpoint folder (`folder` has the layout).

The weights and optimizer come from the layout's files (`fsdp`; the DeepSpeed variant through
the DeepSpeed reader; the plain variant's weights through the HF reader), then the trainer
layer: the step from `trainer_state.json` (else the optimizer's), the scheduler's learning rate
(it is also the lr of every param group in the optimizer state), the optimizer's
hyper-parameters (the param groups'; `training_args.bin`'s where the optimizer state records
none), and the model config from `--config`, the folder's `config.json`, or the output folder's
above it, which one said in a note and in `trainer["config_source"]`.
"""

from __future__ import annotations

import os
from dataclasses import replace

from hybridckpt.errors import FormatError, UnknownModelError
from hybridckpt.formats.trainer import folder as files
from hybridckpt.formats.trainer import fsdp
from hybridckpt.formats.trainer.folder import detect, steps  # noqa: F401 - the format contract
from hybridckpt.io.config_file import read_json
from hybridckpt.io.remote.view import displayed
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "hf-trainer"


def resolve(path: str) -> tuple[str, list[str]]:
    """The checkpoint folder of `path` (itself, or an output folder's latest `checkpoint-N`)."""
    path = os.path.abspath(path)
    if files.layout(path) is not None:
        return path, []
    found = steps(path)
    if found is None:
        raise FormatError(f"{path}: no Trainer / accelerate checkpoint files and no checkpoint-N folder holding them")
    return found.folder(found.default), [f"output folder: {found.note(found.default)}"]


def _config(folder: str, config) -> tuple[object, str | None]:
    """(config, where it came from): `--config`, the folder's config.json, the output folder's."""
    if config is not None:
        return config, "given (--config)"
    from hybridckpt.models import config_from_hf

    for where, d in (("the checkpoint folder's config.json", folder),
                     ("the output folder's config.json (above the checkpoint)", os.path.dirname(folder))):
        p = os.path.join(d, "config.json")
        if os.path.isfile(p):
            try:
                return config_from_hf(read_json(p), source=p), f"{where}: {p}"
            except UnknownModelError:
                return None, f"{where}: {p} (an architecture no family implements: read by its own names)"
    return None, None


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder, notes = resolve(path)
    kind = files.layout(folder)
    cfg, cfg_source = _config(folder, config)
    tf = files.read_trainer_files(folder)
    notes += list(tf.notes)
    if kind == "deepspeed":
        from hybridckpt.formats import deepspeed

        src = deepspeed.open(folder, config=cfg)
        notes.append("Trainer + DeepSpeed: weights and optimizer from the DeepSpeed checkpoint (latest, global_stepN/)")
    elif kind == "fsdp-per-rank":
        raise FormatError(
            f"{folder}: per-rank FSDP files (`*_rank<R>.bin`, accelerate's use_dcp=False) hold rank-local "
            f"shards without their layout: not supported; save with DCP (the default) or FULL_STATE_DICT"
        )
    else:
        src = _fsdp_or_plain(folder, kind, notes)
    src = replace(src, path=path, config=cfg if cfg is not None else src.config)
    return _with_trainer(src, kind, tf, cfg_source, notes)


def _fsdp_or_plain(folder: str, kind: str, notes: list[str]) -> SourceCheckpoint:
    have = files.names(folder)
    models = [n for n in have if files.FSDP_MODEL_RE.match(n)]
    optims = [n for n in have if files.FSDP_OPTIM_RE.match(n)]
    if len(models) > 1 or len(optims) > 1:
        raise FormatError(f"{folder}: several models or optimizers {models + optims}: hybridckpt reads one of each")
    topology: dict = {}
    safetensors = any(os.path.isfile(os.path.join(folder, n)) for n in files.PLAIN_MODELS[:2])
    if kind == "fsdp-sharded":
        tensors = fsdp.dcp_model(os.path.join(folder, models[0]))
        notes.append(f"FSDP SHARDED_STATE_DICT: model from {models[0]}/ (DCP)")
    elif safetensors:  # plain, or the Trainer's FULL_STATE_DICT save_pretrained beside its .bin
        tensors = _hf_weights(folder)
        if models:
            notes.append(f"FSDP FULL_STATE_DICT: model from model.safetensors ({models[0]}, the same state "
                         f"dict as torch.save wrote it, not read)")
    elif models:  # FULL_STATE_DICT from accelerate's save_state
        tensors = fsdp.full_model(os.path.join(folder, models[0]))
        notes.append(f"FSDP FULL_STATE_DICT: model from {models[0]}")
    else:
        tensors = _hf_weights(folder)
    optim_path = os.path.join(folder, optims[0]) if optims else fsdp.optimizer_file(folder, list(files.PLAIN_OPTIMIZERS))
    optimizer = by_index = None
    if optim_path is not None:
        if os.path.isdir(optim_path):
            slots, step, more, hyper = fsdp.dcp_optimizer(optim_path)
        else:
            slots, step, hyper, more, by_index = fsdp.torch_optimizer(optim_path, tensors, _tool(have))
        notes += more
        if slots:
            optimizer = OptimizerState(slots, step, hyper=hyper)
            notes.append(f"optimizer from {os.path.basename(optim_path)}")
            orphans = sorted(set(next(iter(slots.values()))) - set(tensors))
            if orphans:
                raise FormatError(f"{optim_path}: optimizer state for {orphans[:3]}, which the model files do not hold")
        elif hyper and by_index is None:  # (an index-keyed state is named in jobs.open)
            notes.append(f"{os.path.basename(optim_path)}: hyper-parameters only")
    return SourceCheckpoint(NAME, folder, tensors, optimizer=optimizer, topology=topology,
                            trainer={"_hyper_only": hyper} if optimizer is None and optim_path is not None and hyper else {},
                            index_optimizer=by_index)


def _tool(have: list[str]) -> str:
    """Who wrote a plain folder's index-keyed optimizer: the Trainer (its `trainer_state.json` /
    `training_args.bin` beside it) or accelerate's `save_state` alone (`optim.index_names` groups
    the parameters by that tool's rule)."""
    return "trainer" if files.TRAINER_STATE in have or files.TRAINING_ARGS in have else "accelerate"


def _hf_weights(folder: str) -> dict:
    from hybridckpt.formats.hf import INDEX, WEIGHTS, read_tensors

    tensors = read_tensors(folder, WEIGHTS, INDEX)
    if not tensors and os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        tensors = fsdp.full_model(os.path.join(folder, "pytorch_model.bin"))
    if not tensors:
        raise FormatError(f"{folder}: no model weights ({WEIGHTS}, its index, pytorch_model.bin or pytorch_model_fsdp_0)")
    return tensors


def _with_trainer(src: SourceCheckpoint, kind: str, tf: files.TrainerFiles, cfg_source: str | None,
                  notes: list[str]) -> SourceCheckpoint:
    """The trainer layer over the weights and optimizer (see the module doc)."""
    trainer = {k: v for k, v in src.trainer.items() if k != "_hyper_only"}
    trainer |= {"trainer_layout": kind, **{f"trainer_state.{k}": v for k, v in tf.state.items()}}
    opt = src.optimizer
    hyper = dict(opt.hyper) if opt is not None else dict(src.trainer.get("_hyper_only") or {})
    for k, v in tf.args_hyper.items():
        if k not in hyper and k != "optim":
            hyper[k] = v  # training_args.bin where the optimizer state records none
    if tf.args_hyper.get("optim"):
        trainer["training_args.optim"] = tf.args_hyper["optim"]
    if tf.lr is not None:
        trainer["lr"] = tf.lr
        if "lr" in hyper and abs(hyper["lr"] - tf.lr) > 1e-12 * max(1.0, abs(tf.lr)):
            notes.append(f"the scheduler's learning rate {tf.lr} differs from the optimizer state's {hyper['lr']}")
    if tf.lrs:
        trainer["scheduler_lrs"] = list(tf.lrs)
    if cfg_source is not None:
        trainer["config_source"] = cfg_source = displayed(cfg_source)  # in a bucket: its URL, not the view's
        notes.append(f"model config from {cfg_source}")
    step = next((s for s in (tf.step, src.step, opt.step if opt is not None else None) if s is not None), None)
    if opt is not None:
        if opt.step is not None and tf.step is not None and opt.step != tf.step:
            notes.append(f"trainer_state.json's global_step {tf.step} differs from the optimizer's step {opt.step}")
        opt = replace(opt, hyper=hyper)
    if hyper:
        trainer["optimizer_hyper"] = hyper
    return replace(src, format=NAME, optimizer=opt, step=step, trainer=trainer, notes=(*src.notes, *notes))
