"""Paths that a checkpoint file names, kept inside the checkpoint's folder.

The line drawn (docs/security.md, "Threat model"): a path the user typed is trusted; a path a file told us
(an index's `weight_map` file, a DCP storage path, DeepSpeed's `latest` tag, an OCDBT value
reference) is data. `inside(folder, rel, where)` accepts it only as a relative path whose every
component is a plain name: not absolute, no `..`, no empty or `.` component games, no NUL, no
backslash (a Windows separator that POSIX would take as a name character, so that a file written
there and read here could not mean two things), at most `MAX_PATH_CHARS`. The check is lexical:
what the user's filesystem holds as a symlink below the folder is followed (the Hugging Face
cache is a folder of symlinks into `blobs/`): the user chose that folder, a file's content did not.
"""

from __future__ import annotations

import os

from hybridckpt.errors import CheckpointError, FormatError, short_repr

MAX_PATH_CHARS = 1024  # longer names from a file are refused (Linux: 4096 per path, 255 a name)


def check_relative(rel: object, where: str, what: str = "path") -> str:
    """`rel` when it is a plain relative path (see the module doc), else one FormatError naming
    `where` (the file and key it came from) and the value."""
    if not isinstance(rel, str) or not rel:
        raise FormatError(f"{where}: {what} {short_repr(rel)} is not a file name")
    bad = None
    if len(rel) > MAX_PATH_CHARS:
        bad = f"longer than {MAX_PATH_CHARS} characters"
    elif "\x00" in rel:
        bad = "contains a NUL character"
    elif "\\" in rel:
        bad = "contains a backslash"
    elif rel.startswith("/"):
        bad = "is absolute"
    elif any(part in ("", ".", "..") for part in rel.split("/")):
        bad = "has an empty, '.' or '..' component"
    if bad is not None:
        raise FormatError(f"{where}: {what} {short_repr(rel)} {bad}; only a path inside the checkpoint folder is read")
    return rel


def inside(folder: str, rel: object, where: str, what: str = "path") -> str:
    """`folder/rel` for a path `rel` read from a file (`where`: the file and key); FormatError when
    `rel` could leave `folder` (see the module doc)."""
    return os.path.join(folder, check_relative(rel, where, what))


def plain_name(name: object, where: str, what: str = "name") -> str:
    """A single path component read from a file (a tag, a folder name): `inside` with no `/`."""
    rel = check_relative(name, where, what)
    if "/" in rel:
        raise FormatError(f"{where}: {what} {short_repr(rel)} is not a single folder or file name")
    return rel


def given(path: object, role: str) -> str:
    """`path` as a string, or a CheckpointError when it is empty (`role`: "the source", "the
    destination"): an empty path is never taken to mean the working directory."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else path
    if not isinstance(text, str) or text == "":
        raise CheckpointError(f"an empty path was given as {role}: name a folder or file")
    return text
