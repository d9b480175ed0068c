"""JSON metadata files, small text files (trackers, tags), and the HF-style `config.json` that
many checkpoints keep beside them. Every read is bounded (`MAX_METADATA_BYTES`): a metadata file
is data from the checkpoint, and a multi-gigabyte "config" is refused, not loaded."""

from __future__ import annotations

import os

from hybridckpt.errors import ConfigError, FormatError, UnknownModelError
from hybridckpt.io import json_text
from hybridckpt.io.regular_file import open_regular_file

MAX_METADATA_BYTES = 256 << 20  # bytes: the largest JSON index or metadata file read
MAX_TEXT_BYTES = 4096  # bytes: the largest tracker / tag file (`latest`, `latest_checkpointed_iteration.txt`)


def read_bytes(path: str, limit: int = MAX_METADATA_BYTES) -> bytes:
    """The bytes of a metadata file, at most `limit`; FormatError naming the file when it is
    missing, unreadable or larger."""
    try:
        f = open_regular_file(path)  # a regular file: never a FIFO (would block) or a device
    except FormatError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise FormatError(f"{path}: missing") from None
        raise
    try:
        with f:  # by pieces: read(limit) would allocate `limit` bytes at once
            parts, got = [], 0
            while got <= limit:
                piece = f.read(min(1 << 20, limit + 1 - got))
                if not piece:
                    break
                parts.append(piece)
                got += len(piece)
            raw = b"".join(parts)
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) > limit:
        raise FormatError(f"{path}: larger than {limit} bytes; not a metadata file this format writes")
    return raw


def read_small_text(path: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The stripped UTF-8 text of a tracker or tag file; FormatError when it is not that."""
    raw = read_bytes(path, limit)
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not UTF-8 text") from None


def read_json(path: str) -> dict:
    """A JSON object from `path`; FormatError naming the file when it is missing or malformed."""
    return parse_json(read_bytes(path), path)


def parse_json(text: str | bytes, where: str) -> dict:
    """A JSON object from `text` (a file's bytes, or a string stored inside a file); FormatError
    naming `where` (the file, and the key when the JSON is a value inside it) when malformed."""
    data = json_text.loads(text, where)  # one line when malformed or nested past its depth limit
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
    from hybridckpt.models import config_from_hf

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
