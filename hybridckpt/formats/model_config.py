"""The model config a user names (`--config`) and the model files that travel with a checkpoint.

`load_config_file` reads an HF `config.json` or a Meta `params.json` (or a folder holding one) into
a model config; `model_files_of` finds the config, generation config and tokenizer files a source
carries (`io.model_files`), which an import stores and an HF export writes.
"""

from __future__ import annotations

import os
from typing import Any

from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.io import model_files
from hybridckpt.io.config_file import read_json
from hybridckpt.io.model_files import ModelFile


def config_file(path: str) -> str:
    """The config file `--config` names: the file itself, or in a folder its `config.json` (HF),
    else its `params.json` (Meta); a folder with neither is a ConfigError."""
    if not os.path.isdir(path):
        return path
    for name in ("config.json", "params.json"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ConfigError(f"--config {path}: a folder without config.json or params.json; expected an HF config.json "
                      f"or a Meta params.json (or a folder holding one)")


def load_config_file(path: str, vocab_size: int | None = None) -> Any:
    """A model config from an HF `config.json` or a Meta `params.json` (or a folder holding one:
    `config_file`)."""
    from hybridckpt import models

    path = config_file(path)
    try:
        data = read_json(path)
    except FormatError as e:  # missing or not a JSON object: a bad --config
        raise ConfigError(str(e)) from None
    if "dim" in data and "n_layers" in data:
        return models.config_from_meta_params(data, vocab_size=vocab_size, source=path)
    return models.config_from_hf(data, source=path)


def config_arg(config: Any) -> Any:
    """`config` may be a path (config.json / params.json), a model config, or None."""
    if isinstance(config, str | os.PathLike):
        return load_config_file(os.fspath(config))
    return config


def model_files_of(src: Any, path: str, config: Any) -> tuple[dict[str, ModelFile], list[str]]:
    """The config, generation and tokenizer files that travel with `src` (`io.model_files`):
    what our store recorded; else those in the source's folder (or, when its config.json lies in
    the folder above, as for torchtitan's `step-N` and PaddleFormers' `checkpoint-N`, there);
    a `--config` file is the config.json, with the files beside it."""
    if src.format == "orbax" or src.files:  # (ours: what the import stored, nothing else)
        return dict(src.files), []
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    files, skipped = model_files.find(folder)
    if model_files.CONFIG not in files and config is None and src.config is not None:
        above, more = model_files.find(os.path.dirname(folder))
        if model_files.CONFIG in above:
            files, skipped = above | files, skipped + more
    if isinstance(config, str | os.PathLike):
        cpath = os.path.abspath(config_file(os.fspath(config)))
        data = read_json(cpath)
        if not ("dim" in data and "n_layers" in data):  # an HF config.json (a Meta params.json is not carried)
            beside, more = model_files.find(os.path.dirname(cpath))
            files, skipped = files | beside, skipped + more
            files[model_files.CONFIG] = ModelFile(model_files.CONFIG, cpath, os.path.getsize(cpath))
    return files, skipped
