"""Where a DeepSpeed checkpoint keeps its rank files, and the small readers of their contents.

Layout (deepspeedai/DeepSpeed: deepspeed/runtime/engine.py `save_checkpoint`, `_get_ckpt_name`,
`_get_zero_ckpt_name`): `<save>/latest` holds the tag; `<save>/<tag>/` (default
`global_step{N}`) holds `mp_rank_00_model_states.pt` (stage <= 2) or
`zero_pp_rank_{dp}_mp_rank_00_model_states.pt` (stage 3, one per DP rank), and
`[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hybridckpt import lazy
from hybridckpt.errors import FormatError
from hybridckpt.io.config_file import MAX_TEXT_BYTES, read_small_text
from hybridckpt.io.paths import inside
from hybridckpt.io.step_folders import StepFolders, StepPattern, listing
from hybridckpt.lazy import LazyTensor

OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL3_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
TAG_DIRS = StepPattern("global_step")  # engine.save_checkpoint's default tag, `global_step{N}`


def file_names(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _is_tag_dir(folder: str) -> bool:
    return any(OPTIM_RE.match(n) or MODEL_RE.match(n) or MODEL3_RE.match(n) for n in file_names(folder))


def tag_dir(path: str) -> str:
    """The folder holding the rank files: `path` itself, `path/<latest tag>`, or its one tag."""
    if _is_tag_dir(path):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        tag = read_small_text(latest)
        folder = inside(path, tag, latest, "tag")
        if not _is_tag_dir(folder):
            raise FormatError(
                f"{latest}: names tag {tag!r}, but {folder} holds no DeepSpeed rank files"
            )
        return folder
    tags = [n for n in file_names(path) if _is_tag_dir(os.path.join(path, n))]
    if len(tags) == 1:
        return os.path.join(path, tags[0])
    if tags:
        raise FormatError(
            f"{path}: no 'latest' file and several tags {tags[:5]}: pass one tag folder"
        )
    raise FormatError(f"{path}: no DeepSpeed '*_model_states.pt' / '*_optim_states.pt' files")


def tag_steps(path: str, pattern: StepPattern, latest_file: str, holds) -> StepFolders | None:
    """The step tags (`global_stepN/`) of a save folder that `holds` accepts (names only), the
    tag its `latest_file` names the default when it is one of them; None when there are none."""
    if not os.path.isdir(path) or holds(path):
        return None
    latest, default = os.path.join(path, latest_file), None
    if os.path.isfile(latest):
        try:
            default = pattern.number(read_small_text(latest))
        except (FormatError, OSError):
            default = None  # (opening the default says what is wrong with it)
    found = listing(path, pattern, holds, default=default,
                    default_from=f"'{latest_file}'" if os.path.isfile(latest) else None)
    return found if found.folders else None


def steps(path: str) -> StepFolders | None:
    """A save folder's `global_stepN` tag folders, `latest`'s the default (`io.step_folders`)."""
    return tag_steps(path, TAG_DIRS, "latest", _is_tag_dir)


def detect(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if _is_tag_dir(path):
        return True
    # a `latest` tag file: DeepSpeed's (opening it then says what is wrong with the tag it names)
    latest = os.path.join(path, "latest")
    return os.path.isfile(latest) and os.path.getsize(latest) <= MAX_TEXT_BYTES


# -- small readers -----------------------------------------------------------------------------


def get_key(d, key: str, what: str):
    """`d[key]`; a FormatError naming `what` when `d` is not a dict holding it."""
    if not isinstance(d, Mapping) or key not in d:
        raise FormatError(f"{what}: no '{key}'")
    return d[key]


def flat(t, what: str) -> LazyTensor:
    """`t` (a tensor) as one flat dim."""
    if not isinstance(t, LazyTensor):
        raise FormatError(f"{what}: expected a tensor, found {type(t).__name__}")
    return t if t.ndim == 1 else lazy.reshape(t, (t.size,))


def shape_of(s, what: str) -> tuple[int, ...]:
    """A recorded shape (list or tuple of non-negative ints) as a tuple."""
    if not isinstance(s, (tuple, list)) or not all(isinstance(i, int) and i >= 0 for i in s):
        raise FormatError(f"{what}: bad shape {s!r}")
    return tuple(int(i) for i in s)


def cut(flat: LazyTensor, start: int, numel: int, shape: tuple[int, ...]) -> LazyTensor:
    """Elements `[start, start + numel)` of a flat tensor, shaped `shape`."""
    return lazy.reshape(lazy.slice_axis(flat, 0, start, start + numel), shape)
