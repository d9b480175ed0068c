"""What a destination may be, and what `--overwrite` may replace: only what hybridckpt wrote.

A destination path must be given (`""` is an error, never the working directory) and is never
a place a user lives in: the working directory or a folder above it, the home folder, `/`, or a
path beginning with an unexpanded `~` (a folder literally named `~`, later `rm -rf ~`'d). These
are refused with or without `--overwrite`.

`--overwrite` replaces what is at the destination only when hybridckpt wrote it:

- **an export**: every export folder carries `MARKER` (`.hybridckpt-export`, a small JSON file:
  `{"written_by": "hybridckpt", "version", "files": [every file written, relative, "/"-separated]}`).
  The folder is ours when the marker is there and every file in it is one the marker lists (a
  file the user added since, say `notes.txt`, is named and the folder kept). The marker is a
  dotfile beside the checkpoint's own files: Transformers, PaddleFormers, torch DCP, Megatron's
  dist_checkpointing and Orbax/MaxText open the files they name and ignore it.
- **our store** (an import, a `CheckpointStore` run), recognised by what it writes: only step
  folders `<N>/` (or Orbax's `<N>.orbax-checkpoint-tmp*` of an unfinished save), each holding
  only the store's items (`STEP_ENTRIES`).
- an empty file (nothing to lose).

Anything else (a folder of other files, a non-empty file, a symlink) is refused in one line
naming what is there. And a folder that a source file links into (the Hugging Face cache:
`snapshots/<rev>/*` are symlinks into `blobs/`) is never replaced, whoever wrote it: the
source's files would dangle.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

from hybridckpt.errors import CheckpointError

MARKER = ".hybridckpt-export"
MAX_MARKER_BYTES = 64 * 1024 * 1024  # a marker listing ~1M files; a larger one is not ours
MAX_LISTED = 1_000_000  # entries looked at in a folder before it is called foreign

# what `store.layout` puts in a step folder (its items, `hf_files`) and what Orbax adds
STEP_ENTRIES = frozenset({"params", "opt_state", "trainer_state", "hf_files", "_CHECKPOINT_METADATA",
                          "commit_success.txt"})
ORBAX_TMP = ".orbax-checkpoint-tmp"  # Orbax's TMP_DIR_SUFFIX (atomicity_types), then "-<time>" or nothing
_STEP = re.compile(r"\d+(\.orbax-checkpoint-tmp(-\d+)?)?")
STEP_TMP = re.compile(r"\d+\.orbax-checkpoint-tmp(-\d+)?")
ITEM_TMP = re.compile(r"[a-z_]+\.orbax-checkpoint-tmp(-\d+)?")


def check_not_a_home(raw: str, dst: str) -> None:
    """A CheckpointError when the destination `dst` (absolute; `raw` as given) is `/`, the
    home folder, the working directory or one above it, or starts with an unexpanded `~`."""
    if raw == "~" or raw.startswith("~/"):
        raise CheckpointError(f"{raw}: starts with '~', which no shell expanded; give the full path "
                              f"(hybridckpt would create a folder named '~')")
    real = os.path.realpath(dst)
    home = os.path.realpath(os.path.expanduser("~"))
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the working directory was removed
        cwd = None
    what = None
    if real == os.sep:
        what = "is the root folder /"
    elif real == home:
        what = "is the home folder"
    elif cwd is not None and real == cwd:
        what = "is the working directory"
    elif cwd is not None and cwd.startswith(real.rstrip(os.sep) + os.sep):
        what = f"holds the working directory {cwd}"
    if what is not None:
        raise CheckpointError(f"{dst}: the destination {what}; hybridckpt never writes over it: "
                              f"name a new folder, e.g. {os.path.join(dst, 'out')}")


def foreign(path: str) -> tuple[int, list[str]]:
    """What in the folder `path` hybridckpt did not write: (count, the first few relative
    names); (0, []) when all of it is ours (module doc). Counts at most `MAX_LISTED`."""
    listed = _marker_files(os.path.join(path, MARKER))
    if listed is not None:
        return _unlisted(path, listed)
    return _not_store(path)


def check_replaceable(dst: str) -> None:
    """A CheckpointError unless what is at `dst` may be replaced by `--overwrite` (module doc)."""
    if os.path.islink(dst):
        raise CheckpointError(f"{dst}: is a symlink (to {os.readlink(dst)}), not written by hybridckpt; it is "
                              f"never replaced: give the link's target, or another destination")
    if not os.path.isdir(dst):
        try:
            size = os.lstat(dst).st_size
        except FileNotFoundError:
            return
        if os.path.isfile(dst) and size == 0:
            return
        raise CheckpointError(f"{dst}: is a file of {size} bytes not written by hybridckpt; it is never "
                              f"replaced: remove it or choose another destination")
    count, names = foreign(dst)
    if count:
        shown = ", ".join(_printable(n) for n in names) + (", ..." if count > len(names) else "")
        more = "or more " if count >= MAX_LISTED else ""
        raise CheckpointError(f"{dst}: holds {more}{count} file{'s' if count != 1 else ''} not written by "
                              f"hybridckpt: {shown}; only a folder hybridckpt wrote is replaced: remove {'it' if count == 1 else 'them'} "
                              f"or choose another destination")


def check_no_links_into(dst: str, sources: Iterable[str]) -> None:
    """A CheckpointError when a file or folder of a source is a symlink into `dst` (resolved):
    replacing `dst` would leave the source's links dangling."""
    d = os.path.realpath(dst).rstrip(os.sep) + os.sep
    for src in sources:
        if not os.path.isdir(src):
            continue
        seen = 0
        for root, dirs, files in os.walk(src):
            for name in dirs + files:
                seen += 1
                p = os.path.join(root, name)
                if os.path.islink(p):
                    target = os.path.realpath(p)
                    if (target + os.sep).startswith(d):
                        raise CheckpointError(
                            f"{dst}: the source {src} links into it ({os.path.relpath(p, src)} -> {target}); "
                            f"replacing it would break the source: write somewhere else"
                        )
            if seen > MAX_LISTED:
                return


def write_marker(folder: str) -> None:
    """Write `MARKER` into the finished export `folder`, listing every file in it."""
    from importlib import metadata

    try:  # (the installed distribution's: this layer does not import the package's top)
        version = metadata.version("hybridckpt")
    except metadata.PackageNotFoundError:
        version = "unknown"
    files = sorted(_files(folder))
    body = {"written_by": "hybridckpt", "version": version, "files": files}
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(body, f, indent=0)
        f.write("\n")


# -- helpers ---------------------------------------------------------------------------------------


def _files(folder: str):
    """Relative, "/"-separated paths of everything under `folder` that is not a folder (files,
    symlinks, special files), the marker excepted; at most `MAX_LISTED` + 1."""
    n = 0
    for root, dirs, files in os.walk(folder):
        rel = os.path.relpath(root, folder)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
            if path != MARKER:
                n += 1
                yield path
                if n > MAX_LISTED:
                    return


def _marker_files(marker: str) -> set[str] | None:
    """The files a marker lists, or None when there is no readable marker of ours."""
    try:
        if not os.path.isfile(marker) or os.path.islink(marker) or os.path.getsize(marker) > MAX_MARKER_BYTES:
            return None
        with open(marker, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    files = body.get("files") if isinstance(body, dict) and body.get("written_by") == "hybridckpt" else None
    if not isinstance(files, list) or not all(isinstance(x, str) for x in files):
        return None
    return set(files)


def _unlisted(folder: str, listed: set[str]) -> tuple[int, list[str]]:
    extra = sorted(p for p in _files(folder) if p not in listed)
    return len(extra), extra[:5]


def _not_store(folder: str) -> tuple[int, list[str]]:
    """Entries of `folder` that do not fit our store's layout (module doc); every entry when
    it holds no step folder at all."""
    entries = sorted(os.listdir(folder))[:MAX_LISTED]
    steps = [e for e in entries if _STEP.fullmatch(e) and os.path.isdir(os.path.join(folder, e))
             and not os.path.islink(os.path.join(folder, e))]
    if not steps:
        return len(entries), entries[:5]
    extra = [e for e in entries if e not in steps]
    for step in steps:
        for child in sorted(os.listdir(os.path.join(folder, step))):
            if child not in STEP_ENTRIES and not ITEM_TMP.fullmatch(child):
                extra.append(f"{step}/{child}")
    return len(extra), extra[:5]


def _printable(name: str) -> str:
    name = name if len(name) <= 80 else name[:77] + "..."
    return name if name.isprintable() else repr(name)
