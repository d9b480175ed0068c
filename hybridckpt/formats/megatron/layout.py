"""Where a Megatron-LM torch-format checkpoint keeps its files, and its parallel layout.

Layout (NVIDIA/Megatron-LM:megatron/training/checkpointing.py `get_checkpoint_name`,
`read_metadata`):
- `<save>/latest_checkpointed_iteration.txt` (`TRACKER`): an integer or `release`; the folder is
  `iter_{N:07d}` or `release`. A path may be the save folder or the iteration folder; the
  tracker's is read unless another iteration is asked for (`steps`, `--step`).
- One folder per model-parallel rank: `mp_rank_{tp:02d}` (PP = 1) or `mp_rank_{tp:02d}_{pp:03d}`,
  `_{ep:03d}` appended when EP > 1; each holds `model_optim_rng.pt` (`MODEL_FILE`) and, with
  `--use-distributed-optimizer`, `distrib_optim.pt` (`OPTIM_FILE`).
- The degrees come from the pickled `args` (argparse.Namespace): tensor / pipeline / virtual
  pipeline / expert model parallel sizes, and the data-parallel size (given, or world / (tp*pp)).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.errors import FormatError, short_repr
from hybridckpt.io.config_file import read_small_text
from hybridckpt.io.step_folders import StepFolders, StepPattern, listing

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
ITER_DIRS = StepPattern("iter_")  # `iter_{N:07d}` (any number of digits read)
RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")


def _has_rank_dirs(folder: str) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(
        RANK_DIR.match(n) and os.path.isfile(os.path.join(folder, n, MODEL_FILE)) for n in names
    )


def detect(path: str) -> bool:
    """A save folder whose tracker names a folder of `mp_rank_*` dirs, or such a folder itself
    (Megatron's `torch_dist` format has the tracker too, but `.distcp` files: not ours)."""
    if not os.path.isdir(path):
        return False
    try:
        return _has_rank_dirs(iteration_dir(path))
    except FormatError:  # (a tracker naming a folder that is not there: its other iterations still count)
        return steps(path) is not None


def tracked_folder(save: str) -> str:
    """The iteration folder (`iter_NNNNNNN` or `release`) that `save`'s tracker file
    (`latest_checkpointed_iteration.txt`) names; FormatError when it is malformed or missing.
    Megatron-LM writes the same tracker for legacy and torch_dist saves."""
    tracker = os.path.join(save, TRACKER)
    text = read_small_text(tracker)
    if text == "release":
        name = "release"
    elif text.isascii() and text.isdigit() and len(text) <= 12:
        name = f"iter_{int(text):07d}"
    else:
        raise FormatError(f"{tracker}: expected an iteration number or 'release', found {short_repr(text)}")
    folder = os.path.join(save, name)
    if not os.path.isdir(folder):
        raise FormatError(f"{tracker} names {text!r} but the folder {folder} is missing")
    return folder


def _tracked_iteration(save: str) -> int | None:
    """The iteration the tracker of `save` names, or None (no tracker, `release`, malformed:
    opening the default then says which)."""
    try:
        text = read_small_text(os.path.join(save, TRACKER))
    except (FormatError, OSError):
        return None
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else None


def iteration_folders(save: str, holds) -> StepFolders:
    """The `iter_N` folders of a save folder that `holds` accepts (names only), the tracker's
    iteration the default (`io.step_folders`)."""
    tracked = os.path.isfile(os.path.join(save, TRACKER))
    return listing(save, ITER_DIRS, holds, default=_tracked_iteration(save) if tracked else None,
                   default_from=TRACKER if tracked else None)


def steps(path: str) -> StepFolders | None:
    """The `iter_N` folders of a save folder (each with `mp_rank_*` folders), or None when `path`
    is an iteration folder itself or holds none."""
    if not os.path.isdir(path) or _has_rank_dirs(path):
        return None
    found = iteration_folders(path, _has_rank_dirs)
    return found if found.folders else None


def iteration_dir(path: str) -> str:
    """The `iter_N` / `release` folder of `path` (a save folder or the iteration folder)."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        return tracked_folder(path)
    if _has_rank_dirs(path):
        return path
    raise FormatError(f"{path}: no {TRACKER} and no mp_rank_* folders: not a Megatron checkpoint")


def arg(args: Any, name: str, default=None):
    """`args.<name>` (the pickled argparse.Namespace), or `default` when unset or no args."""
    return getattr(args, name, default) if args is not None else default


def rank_folder(tp_rank: int, pp_rank: int, *, pp: int, ep: int = 1, ep_rank: int = 0) -> str:
    """Megatron's rank folder name (checkpointing.py `get_checkpoint_name`)."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep > 1 else "")


def first_file(it_dir: str) -> str:
    """The `model_optim_rng.pt` of tensor and pipeline rank 0 (the one every reader opens)."""
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        f = os.path.join(it_dir, name, MODEL_FILE)
        if os.path.isfile(f):
            return f
    raise FormatError(
        f"{it_dir}: the tensor/pipeline rank 0 folder (mp_rank_00 or mp_rank_00_000) is missing"
    )


def load_state(path: str) -> Mapping:
    """A rank file's pickled dict (no tensor bytes read)."""
    # (imported on a read: detection imports this module for every source)
    from hybridckpt.containers.pickle import torch_save

    state = torch_save.load(path)
    if not isinstance(state, Mapping):
        raise FormatError(f"{path}: expected a dict, found {type(state).__name__}")
    return state


@dataclass(frozen=True)
class Topology:
    """Parallel degrees: tensor, pipeline, virtual pipeline, expert, data."""

    tp: int
    pp: int
    vpp: int
    ep: int
    dp: int


def topology(args, file: str) -> Topology:
    """The degrees `args` give (`file` names the checkpoint in errors)."""

    def deg(name, default=1):
        v = arg(args, name, default)
        v = default if v is None else v
        if not isinstance(v, int) or v < 1:
            raise FormatError(f"{file}: args.{name} should be a positive int, found {v!r}")
        return v

    tp, pp = deg("tensor_model_parallel_size"), deg("pipeline_model_parallel_size")
    world = arg(args, "world_size")
    dp = arg(args, "data_parallel_size")
    if dp is None and isinstance(world, int) and world >= tp * pp:
        dp = world // (tp * pp)
    return Topology(
        tp=tp,
        pp=pp,
        vpp=deg("virtual_pipeline_model_parallel_size"),
        ep=deg("expert_model_parallel_size"),
        dp=dp if isinstance(dp, int) and dp >= 1 else 1,
    )
