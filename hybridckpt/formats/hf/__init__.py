"""Hugging Face checkpoints: `config.json` + `model.safetensors` or sharded with an index.

Layout (huggingface/transformers:src/transformers/modeling_utils.py, `save_pretrained`):
- `config.json`: the model config (`architectures`, `model_type`, sizes).
- `model.safetensors`, or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`
  `{"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}`.
- hybridckpt's single-card "unified" format adds `optimizer.safetensors` (or sharded with
  `optimizer.safetensors.index.json`) holding `<hf name>.<slot>` per parameter (AdamW:
  `exp_avg`, `exp_avg_sq`; any optimizer's slot names, `hybridckpt.optim`) and a 0-d `step`,
  plus `hybridckpt.json` with trainer metadata.
- Legacy torch shards (`pytorch_model.bin`, `pytorch_model-0000i-of-0000N.bin` with or without
  `pytorch_model.bin.index.json`) when there is no safetensors file: `formats.hf.bin`.
- Quantized releases (`quantization_config` FP8 blocks or MXFP4) are dequantized on import:
  `formats.hf.quant` (the config read on is the source's without `quantization_config`).
- An architecture no family implements is read under its own names; its `config.json` is kept
  (trainer `"hf_config"`) so that an export writes it back (`formats.hf.write`).
Tensor names are HF names already, so `hf_rules` is empty (GPT-2 files without the
`transformer.` prefix get a one-line rename).
"""

from __future__ import annotations

import os

from hybridckpt import models
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import ConfigError, FormatError, UnknownModelError, short_repr
from hybridckpt.formats.hf import bin as hf_bin
from hybridckpt.formats.hf import quant as hf_quant
from hybridckpt.io.config_file import read_json
from hybridckpt.io.paths import check_relative
from hybridckpt.lazy import LazyTensor, scalar_value
from hybridckpt.optim.torch_optim import check_complete
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
    return (os.path.isfile(os.path.join(path, WEIGHTS)) or os.path.isfile(os.path.join(path, INDEX))
            or hf_bin.present(path))


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


def _model_files(path: str, folder: str) -> tuple[dict[str, LazyTensor], str]:
    """(the model's tensors, which files held them) of a file, or a folder's safetensors (else
    its torch shards)."""
    if os.path.isfile(path):
        return _safetensors_file(path), os.path.basename(path)
    tensors = read_tensors(folder, WEIGHTS, INDEX)
    if tensors:
        return tensors, INDEX if os.path.isfile(os.path.join(folder, INDEX)) else WEIGHTS
    if hf_bin.present(folder):
        return hf_bin.read(folder, read_index(os.path.join(folder, hf_bin.INDEX)))
    raise FormatError(f"{path}: no {WEIGHTS}, {INDEX} or {hf_bin.SINGLE}")


def _safetensors_file(path: str) -> dict[str, LazyTensor]:
    """The tensors of a file given as the source: one line saying it is not a safetensors file
    when its header is not one (a torch.save file named with `--format hf`, say)."""
    from hybridckpt.containers.pickle import torch_save

    if torch_save.is_torch_zip(path) or torch_save.is_torch_legacy(path):
        raise FormatError(f"{path} is not a safetensors file: it is a torch.save file "
                          f"(read as --format torch, which detection picks)")
    try:
        return dict(read_header(path).tensors)
    except FormatError as e:
        why = str(e).removeprefix(f"{path}: ")
        raise FormatError(f"{path} is not a safetensors file: {why}") from None


def _config(folder: str, config) -> tuple[object, dict | None]:
    """(the model config or None, the source's `config.json` object or None). A quantized
    config is read without its `quantization_config`; an architecture no family implements
    gives None (read model-agnostic)."""
    from hybridckpt.models import config_from_hf

    path = os.path.join(folder, "config.json")
    raw = read_json(path) if os.path.isfile(path) else None
    if config is not None:
        return config, raw
    if raw is None:
        raise ConfigError(f"{path}: missing; an HF checkpoint needs its config.json (or pass --config)")
    try:
        return config_from_hf(hf_quant.without_quantization(raw), source=path), raw
    except UnknownModelError:
        return None, raw


def architecture(hf_config) -> str:
    """The architecture a `config.json` object names (`architectures[0]`, else its model_type)."""
    archs = (hf_config or {}).get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    mt = (hf_config or {}).get("model_type")
    return mt if isinstance(mt, str) else "an unnamed architecture"


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    tensors, files = _model_files(path, folder)
    if not tensors:
        raise FormatError(f"{path}: no {WEIGHTS} or {INDEX}")
    cfg, raw = _config(folder, config)
    notes: list[str] = []
    trainer: dict = {}
    torch_shards = files not in (WEIGHTS, INDEX) and not os.path.isfile(path)
    ties = hf_bin.tied_copies(tensors) if torch_shards else {}
    if torch_shards:
        notes.append(f"legacy torch weights: {files}")
    notes += [f"{k} is a view of {v}'s storage (a tied copy, read once)" for k, v in ties.items()]
    q = hf_quant.quantization(raw, os.path.join(folder, "config.json"))
    if q is not None:
        tensors, count, qnotes = hf_quant.dequantize(tensors, q, path)
        notes += [f"{q.method} weights of {count} tensors dequantized (stored as {hf_quant.DEFAULT_DTYPE} "
                  f"unless --dtype float32; every other tensor in its own dtype)", *qnotes]
    optim = None
    moments = read_tensors(folder, OPTIMIZER, OPTIMIZER_INDEX)
    if os.path.isfile(os.path.join(folder, TRAINER)):
        trainer = read_json(os.path.join(folder, TRAINER))
    if q is not None:
        trainer["quantization"] = q.describe(count)
    if cfg is None and raw is not None:
        trainer["hf_config"] = hf_quant.without_quantization(raw)
        notes.append(f"{architecture(raw)}: no model family implements it; read under its own names")
    if moments:
        step = None
        if "step" in moments:
            step = int(scalar_value(moments["step"], "optimizer step"))
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
        notes=tuple(notes),
    )
