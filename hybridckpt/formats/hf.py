"""Hugging Face checkpoints: `config.json` + `model.safetensors` or sharded with an index.

Layout (huggingface/transformers:src/transformers/modeling_utils.py, `save_pretrained`):
- `config.json`: the model config (`architectures`, `model_type`, sizes).
- `model.safetensors`, or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`
  `{"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}`.
- hybridckpt's single-card "unified" format adds `optimizer.safetensors` (or sharded with
  `optimizer.safetensors.index.json`) holding `<hf name>.<slot>` per parameter (AdamW:
  `exp_avg`, `exp_avg_sq`; any optimizer's slot names, `hybridckpt.optim`) and a 0-d `step`,
  plus `hybridckpt.json` with trainer metadata.
Tensor names are HF names already, so `hf_rules` is empty (GPT-2 files without the
`transformer.` prefix get a one-line rename).
"""

from __future__ import annotations

import os

from hybridckpt import models
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import FormatError, short_repr
from hybridckpt.formats.config_file import config_beside, read_json
from hybridckpt.formats.torch_optim import check_complete
from hybridckpt.io.paths import check_relative
from hybridckpt.lazy import LazyTensor
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "hf"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
OPTIMIZER = "optimizer.safetensors"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
TRAINER = "hybridckpt.json"


def detect(path: str) -> bool:
    if os.path.isfile(path):
        return path.endswith(".safetensors")
    return os.path.isfile(os.path.join(path, WEIGHTS)) or os.path.isfile(os.path.join(path, INDEX))


def read_index(path: str) -> dict[str, str] | None:
    """The `weight_map` (tensor name -> file name) of an index json, or None when it is absent."""
    if not os.path.isfile(path):
        return None
    weight_map = read_json(path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(f"{path}: expected a 'weight_map' object of name -> file")
    for name, fname in weight_map.items():  # shard files live in the checkpoint's folder
        check_relative(fname, f"{path}: weight_map[{short_repr(name)}]", "file")
    return weight_map


def read_indexed(folder: str, index: str) -> dict[str, LazyTensor]:
    """Lazy tensors of every file `folder/index` names, each checked to be where the index says
    and no file holding tensors the index leaves out; {} when there is no index."""
    index_path = os.path.join(folder, index)
    weight_map = read_index(index_path)
    if weight_map is None:
        return {}
    files: dict[str, dict[str, LazyTensor]] = {}
    out: dict[str, LazyTensor] = {}
    for name, fname in weight_map.items():
        if fname not in files:
            fpath = os.path.join(folder, fname)
            if not os.path.isfile(fpath):
                raise FormatError(f"{index_path}: tensor {name!r} is in {fname}, which is missing")
            files[fname] = dict(read_header(fpath).tensors)
        if name not in files[fname]:
            raise FormatError(f"{os.path.join(folder, fname)}: {index} says it holds {name!r} but it does not")
        out[name] = files[fname][name]
    extra = {n for f in files.values() for n in f} - set(weight_map)
    if extra:
        raise FormatError(f"{index_path}: tensors {sorted(extra)[:10]} are in the files but not in the index")
    return out


def read_tensors(folder: str, single: str, index: str) -> dict[str, LazyTensor]:
    """Lazy tensors of `folder/single`, or of every file named by `folder/index`."""
    if os.path.isfile(os.path.join(folder, index)):
        return read_indexed(folder, index)
    if os.path.isfile(os.path.join(folder, single)):
        return dict(read_header(os.path.join(folder, single)).tensors)
    return {}


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if os.path.isfile(path):
        tensors = dict(read_header(path).tensors)
    else:
        tensors = read_tensors(folder, WEIGHTS, INDEX)
    if not tensors:
        raise FormatError(f"{path}: no {WEIGHTS} or {INDEX}")
    cfg = config_beside(folder, config=config, required_for="an HF checkpoint")
    optim = None
    moments = read_tensors(folder, OPTIMIZER, OPTIMIZER_INDEX)
    trainer: dict = {}
    if os.path.isfile(os.path.join(folder, TRAINER)):
        trainer = read_json(os.path.join(folder, TRAINER))
    if moments:
        step = None
        if "step" in moments:
            step = int(moments["step"].materialize().reshape(-1)[0])
        slots: dict[str, dict[str, LazyTensor]] = {}
        stray = []
        for key, t in moments.items():
            name, _, slot = key.rpartition(".")
            if name in tensors:
                slots.setdefault(slot, {})[name] = t
            elif key != "step":
                stray.append(key)
        if stray:
            raise FormatError(f"{folder}/{OPTIMIZER}: unexpected keys {sorted(stray)[:10]}")
        check_complete(slots, f"{folder}/{OPTIMIZER}")
        optim = OptimizerState(slots, step, hyper=trainer.get("optimizer", {}))
    rules = models.hf_name_fixes(cfg, tensors) if cfg is not None else ""
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optim,
        hf_rules=rules,
        config=cfg,
        step=optim.step if optim else trainer.get("step"),
        trainer=trainer,
    )
