"""The files beside a model's weights that loading and generating with it needs.

A Hugging Face folder is more than its safetensors: `config.json` (with the special token ids and
the dtype), `generation_config.json`, and the tokenizer (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`, `tokenizer.model`, `vocab.json` + `merges.txt`, a chat template, ...).
An import keeps them (`<step>/hf_files/` of our store, each with its size and CRC-32 recorded in the
trainer state) and an export writes them back, so `transformers` loads and generates with the
export as it did with the source.

Which files: the names in `NAMES`, and any other plain name that says it is a tokenizer's
(`is_model_file`). Each is a regular file of at most `MAX_FILE_BYTES`, at most `MAX_FILES` of
them. A name read from a checkpoint (our store's record) is data: it must pass `is_model_file`,
which admits only a single plain file name, never a path. Python files (a tokenizer's
`auto_map` code) are never carried: no code from a checkpoint runs or travels.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hybridckpt.errors import CheckpointError, FormatError, short_repr
from hybridckpt.io.regular_file import open_regular_file

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
NAMES = frozenset({
    CONFIG, GENERATION_CONFIG, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
})  # fmt: skip
_TOKENIZER_WORDS = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "tiktoken", "chat_template")
_PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_NEVER = (".py", ".pyc", ".so", ".safetensors", ".bin", ".pt", ".pth", ".pdparams", ".pdopt", ".distcp", ".npy")
MAX_FILE_BYTES = 64 << 20  # bytes: a tokenizer.json of the largest vocabularies is about 35 MB
MAX_FILES = 64


def is_model_file(name: object) -> bool:
    """Whether `name` is a plain file name of a config, generation config or tokenizer file."""
    if not isinstance(name, str) or not _PLAIN.match(name) or name.lower().endswith(_NEVER):
        return False
    return name in NAMES or any(w in name.lower() for w in _TOKENIZER_WORDS)


def crc32(data: bytes) -> str:
    """The CRC-32 of `data` as 8 hex digits (what our store records per file)."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


@dataclass(frozen=True)
class ModelFile:
    """One carried file: its plain `name`, where its bytes are (`path`), its size in bytes, and
    the CRC-32 (8 hex digits) recorded when it was stored (None for a source's own file)."""

    name: str
    path: str
    size: int
    crc32: str | None = None

    def read(self) -> bytes:
        """The file's bytes: exactly `size` of them (a file that changed or grew past
        `MAX_FILE_BYTES` is an error naming it), matching the recorded CRC-32 when there is one."""
        try:
            with open_regular_file(self.path) as f:
                data = f.read(min(self.size, MAX_FILE_BYTES) + 1)
        except OSError as e:
            raise FormatError(f"{self.path}: cannot read: {e.strerror or e}") from None
        if len(data) != self.size:
            raise CheckpointError(f"{self.path}: expected {self.size} bytes, found {len(data)}")
        if self.crc32 is not None and crc32(data) != self.crc32:
            raise CheckpointError(
                f"{self.path}: CRC-32 {crc32(data)} differs from the {self.crc32} recorded when it was stored"
            )
        return data


def find(folder: str) -> tuple[dict[str, ModelFile], list[str]]:
    """The model files in `folder` (see the module doc), by name ({} when there is no folder),
    and a note for each one left behind (larger than `MAX_FILE_BYTES`, past `MAX_FILES`)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return {}, []
    out: dict[str, ModelFile] = {}
    notes: list[str] = []
    for name in names:
        if not is_model_file(name):
            continue
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)  # (a symlink the user's folder holds is followed: the HF cache)
        except OSError:
            continue
        if not os.path.isfile(path):
            continue
        if st.st_size > MAX_FILE_BYTES or len(out) == MAX_FILES:
            notes.append(f"{path} not carried: more than {MAX_FILE_BYTES} bytes or {MAX_FILES} files")
            continue
        out[name] = ModelFile(name, path, st.st_size)
    return out, notes


def write(folder: str, files: Iterable[ModelFile]) -> dict[str, dict]:
    """Copy `files` into `folder` (each read and checked first); returns the record our store
    keeps of them: name -> {"bytes": size, "crc32": hex}."""
    record = {}
    for f in files:
        data = f.read()
        with open(os.path.join(folder, _checked_name(f.name, folder)), "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        record[f.name] = {"bytes": len(data), "crc32": crc32(data)}
    return record


def recorded(folder: str, record: object, where: str) -> dict[str, ModelFile]:
    """The files our store recorded (`write`'s record, read back from a checkpoint: data) as
    ModelFiles under `folder`; a bad name, size or CRC is an error naming `where`."""
    if record is None:
        return {}
    if not isinstance(record, Mapping) or len(record) > MAX_FILES:
        raise FormatError(f"{where}: expected at most {MAX_FILES} files by name, found {short_repr(record)}")
    out = {}
    for name, info in record.items():
        _checked_name(name, where)
        size = info.get("bytes") if isinstance(info, Mapping) else None
        crc = info.get("crc32") if isinstance(info, Mapping) else None
        if (not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES
                or not isinstance(crc, str) or not re.fullmatch(r"[0-9a-f]{8}", crc)):
            raise FormatError(f"{where}: file {name!r}: expected {{'bytes': 0..{MAX_FILE_BYTES}, 'crc32': 8 hex "
                              f"digits}}, found {short_repr(info)}")
        out[name] = ModelFile(name, os.path.join(folder, name), size, crc)
    return out


def plain(name: object) -> str:
    """`name` when it is the plain name of a config or tokenizer file (`is_model_file`), else a
    FormatError: what a writer checks before it joins a carried name to its folder."""
    return _checked_name(name, "a carried file")


def _checked_name(name: object, where: str) -> str:
    if not is_model_file(name):
        raise FormatError(f"{where}: {short_repr(name)} is not the plain name of a config or tokenizer file")
    return name  # type: ignore[return-value]
