"""What an HF export writes beside the weights, so `transformers` loads and generates with it.

- `config.json`: the source's own (carried through our store: `io.model_files`) byte for byte when
  it describes the exported model (its family config parses equal to the model's), with only its
  `dtype` / `torch_dtype` changed when the export casts; otherwise (no HF config at the source, e.g.
  Megatron, or one that says something else) the family's `config.json` (`models.config_to_hf`:
  RoPE in both transformers 4's `rope_theta` + `rope_scaling` and 5's `rope_parameters`) with the
  source's special token ids and `torch_dtype` (the dtype of most of the exported bytes).
- `generation_config.json`: the source's, else one made from the token ids of that config
  (`{"_from_model_config": true, "bos_token_id": ..}`, what `GenerationConfig.from_model_config`
  makes), so `GenerationConfig.from_pretrained(OUT)` works for every family export.
- Every other carried file (the tokenizer's) as it was.

A `quantization_config` in the carried config is removed (the weights are written dequantized).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt.errors import HybridCkptError
from hybridckpt.io import json_text
from hybridckpt.io.model_files import CONFIG, GENERATION_CONFIG, ModelFile
from hybridckpt.lazy import LazyTensor

TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
QUANTIZATION_KEY = "quantization_config"  # a quantized release's; our exports are dequantized
DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5's name, and 4's (5 reads both)


def main_dtype(params: Mapping[str, LazyTensor]) -> str | None:
    """The floating dtype holding most of the bytes of `params` ("float32", "bfloat16", ...)."""
    by: dict[str, int] = {}
    for t in params.values():
        dt = np.dtype(t.dtype)
        if dt.kind == "f" or dt.name == "bfloat16":
            by[dt.name] = by.get(dt.name, 0) + t.nbytes
    return max(by, key=by.get) if by else None


def _json(data: Mapping) -> bytes:
    return (json.dumps(dict(data), indent=2, sort_keys=True) + "\n").encode()


def _carried_config(f: ModelFile | None) -> dict | None:
    if f is None:
        return None
    try:
        data = json_text.loads(f.read(), f.name)
    except HybridCkptError:
        return None  # not what we can use: the family's own config is written instead
    return data if isinstance(data, dict) else None


def _describes(carried: Mapping, cfg: Any) -> bool:
    """Whether an HF config dict parses to exactly the model config `cfg`."""
    from hybridckpt import models

    try:
        return models.config_to_dict(models.config_from_hf(carried, source=CONFIG)) == models.config_to_dict(cfg)
    except HybridCkptError:
        return False


def export_files(
    cfg: Any, files: Mapping[str, ModelFile], params: Mapping[str, LazyTensor], *,
    source_config: Mapping | None = None,
) -> dict[str, bytes | ModelFile]:
    """The files an HF export writes beside `params` (name -> bytes, or a carried file to copy):
    see the module doc. `cfg`: the model config, or None for a model-agnostic export (then the
    carried files, config.json included, are written as they were). `source_config`: the source's
    config.json object as its reader kept it, used when no config.json was carried. A carried
    config's `quantization_config` is dropped: an export writes dequantized weights."""
    out: dict[str, bytes | ModelFile] = dict(files)
    carried = _carried_config(files.get(CONFIG))
    if carried is None and source_config is not None:
        carried = dict(source_config)
        out[CONFIG] = _json(carried)
    if carried is not None and QUANTIZATION_KEY in carried:
        carried = {k: v for k, v in carried.items() if k != QUANTIZATION_KEY}
        out[CONFIG] = _json(carried)
    if cfg is None:
        return out
    from hybridckpt import models

    dtype = main_dtype(params)
    if carried is not None and _describes(carried, cfg):
        keys = [k for k in DTYPE_KEYS if k in carried]
        if dtype is not None and any(carried[k] != dtype for k in keys):
            out[CONFIG] = _json(carried | {k: dtype for k in keys})
        config = carried
    else:
        config = dict(models.config_to_hf(cfg))
        config |= {k: carried[k] for k in TOKEN_KEYS if carried is not None and k in carried}
        if dtype is not None:
            config[next((k for k in DTYPE_KEYS if carried is not None and k in carried), "torch_dtype")] = dtype
        out[CONFIG] = _json(config)
    if GENERATION_CONFIG not in files:
        out[GENERATION_CONFIG] = _json({"_from_model_config": True,
                                        **{k: config[k] for k in TOKEN_KEYS if config.get(k) is not None}})
    return out
