"""JSON metadata files and the HF-style `config.json` that many checkpoints keep beside them."""

from __future__ import annotations

import json
import os

from hybridckpt.errors import ConfigError, FormatError, UnknownModelError


def read_json(path: str) -> dict:
    """A JSON object from `path`; FormatError naming the file when it is missing or malformed."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FormatError(f"{path}: missing") from None
    return parse_json(raw, path)


def parse_json(text: str | bytes, where: str) -> dict:
    """A JSON object from `text` (a file's bytes, or a string stored inside a file); FormatError
    naming `where` (the file, and the key when the JSON is a value inside it) when malformed."""
    try:
        data = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise FormatError(f"{where}: expected a JSON object, found {type(data).__name__}")
    return data


def config_beside(*folders: str, config=None, required_for: str | None = None):
    """`config` when given, else the model config of the first `folder/config.json` found.

    With `required_for` (e.g. "an HF checkpoint") a missing file is a ConfigError that says so;
    otherwise the result is None and the caller (or `--config`) supplies one. A config.json of an
    architecture no model family implements also gives None: the checkpoint is then read
    model-agnostic, its tensors under their own names (`UnknownModelError` is not raised).
    """
    if config is not None:
        return config
    from models import config_from_hf

    for folder in folders:
        path = os.path.join(folder, "config.json")
        if os.path.isfile(path):
            try:
                return config_from_hf(read_json(path), source=path)
            except UnknownModelError:
                return None
    if required_for:
        path = os.path.join(folders[0], "config.json")
        raise ConfigError(f"{path}: missing; {required_for} needs its config.json (or pass --config)")
    return None
