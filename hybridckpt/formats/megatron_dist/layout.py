"""Where a Megatron-Core distributed checkpoint (`torch_dist`) keeps its files.

Layouts (each resolves to the checkpoint folder that holds the DCP files):
- Megatron-LM (NVIDIA/Megatron-LM:megatron/training/checkpointing.py `get_checkpoint_name`,
  `read_metadata`): `<save>/latest_checkpointed_iteration.txt` (an iteration or `release`),
  `<save>/iter_{N:07d}/` or `release/`. A path may be the save folder or the iteration folder.
- Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge:docs/training/checkpointing.md): the same, plus
  `latest_train_state.pt` at the top and `run_config.yaml`, `train_state.pt` inside `iter_N/`.
- NeMo 2 (NVIDIA/NeMo:nemo/lightning/ckpt_utils.py `WEIGHTS_PATH`, `CONTEXT_PATH`): the
  checkpoint folder is `<ckpt>/weights/` beside `<ckpt>/context/` (model config and
  hyper-parameters).

Inside the checkpoint folder: torch DCP's `.metadata` and `__{rank}_{n}.distcp`, and
`metadata.json` = `{"sharded_backend": "torch_dist", "sharded_backend_version": 1, ...}`
(megatron/core/dist_checkpointing/core.py `save_config`), written LAST, after every rank's data
and the `.metadata` (serialization.py `save`: `metadata_finalize_fn`): a folder without it is an
unfinished save. Older releases also write `common.pt` (strategies/common.py `save_common`).
Only the `torch_dist` backend is read (the retired `zarr` backend is refused by name).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridckpt.containers.dcp_metadata import METADATA, metadata_files
from hybridckpt.errors import FormatError
from hybridckpt.formats.megatron.layout import ITER_DIRS, iteration_folders, tracked_folder
from hybridckpt.io import json_text
from hybridckpt.io.config_file import read_bytes
from hybridckpt.io.step_folders import StepFolders

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM, Bridge
CONFIG_FILE = "metadata.json"  # dist_checkpointing/core.py CONFIG_FNAME
COMMON_FILE = "common.pt"  # dist_checkpointing/strategies/common.py COMMON_STATE_FNAME
BACKEND = "torch_dist"
BRIDGE_TRAIN_STATE = "latest_train_state.pt"
BRIDGE_RUN_CONFIG = "run_config.yaml"
NEMO_WEIGHTS, NEMO_CONTEXT = "weights", "context"


@dataclass(frozen=True)
class Location:
    """A torch_dist checkpoint on disk.

    folder:   the checkpoint folder (DCP files, `metadata.json`)
    flavour:  "megatron-lm", "bridge" or "nemo2"
    context:  NeMo 2's `context/` folder (None otherwise)
    iteration: the iteration the folder name or tracker gives (None for `release` or unnamed)
    """

    folder: str
    flavour: str
    context: str | None = None
    iteration: int | None = None


def _has_dcp_files(folder: str) -> bool:
    if metadata_files(folder):
        return True
    try:
        return any(n.endswith(".distcp") for n in os.listdir(folder))
    except OSError:
        return False


def _tracked(save: str) -> str:
    """The iteration folder the tracker of `save` names (the legacy reader's rule: one tracker)."""
    return tracked_folder(save)


def steps(path: str) -> StepFolders | None:
    """The `iter_N` folders (with DCP files) of a save folder with a tracker, the tracker's
    iteration the default; None for an iteration folder itself, or a folder without them."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, TRACKER)):
        return None
    found = iteration_folders(path, _has_dcp_files)
    return found if found.folders else None


def _iteration(folder: str) -> int | None:
    return ITER_DIRS.number(os.path.basename(os.path.normpath(folder)))


def locate(path: str) -> Location | None:
    """The torch_dist checkpoint `path` names, or None when it does not look like one (cheap:
    file names only, no pickle read). Raises FormatError only for a tracker that points nowhere."""
    if not os.path.isdir(path):
        return None
    path = os.path.abspath(path)
    weights, context = os.path.join(path, NEMO_WEIGHTS), os.path.join(path, NEMO_CONTEXT)
    if os.path.isdir(weights) and os.path.isdir(context) and _has_dcp_files(weights):
        return Location(weights, "nemo2", context, _iteration(path))
    bridge = os.path.isfile(os.path.join(path, BRIDGE_TRAIN_STATE))
    if os.path.isfile(os.path.join(path, TRACKER)):
        folder = _tracked(path)
    else:
        folder = path
        parent = os.path.dirname(path)
        bridge = bridge or os.path.isfile(os.path.join(parent, BRIDGE_TRAIN_STATE))
        # a bare DCP folder is plain DCP unless Megatron marks it: metadata.json, common.pt,
        # Bridge's files, or an iteration folder under a tracker
        marked = (
            os.path.isfile(os.path.join(path, CONFIG_FILE))
            or os.path.isfile(os.path.join(path, COMMON_FILE))
            or os.path.isfile(os.path.join(path, BRIDGE_RUN_CONFIG))
            or (
                (os.path.basename(path) == "release" or ITER_DIRS.number(os.path.basename(path)) is not None)
                and os.path.isfile(os.path.join(parent, TRACKER))
            )
        )
        if not marked:
            return None
    if not _has_dcp_files(folder):
        return None
    bridge = bridge or os.path.isfile(os.path.join(folder, BRIDGE_RUN_CONFIG))
    return Location(folder, "bridge" if bridge else "megatron-lm", None, _iteration(folder))


def detect(path: str) -> bool:
    """A torch_dist checkpoint (finished or not: `open` says which) or the folder holding one. A
    `metadata.json` without `sharded_backend` is someone else's file: not claimed."""
    try:
        loc = locate(path)
    except (FormatError, OSError):  # (a tracker naming a folder that is not there: its other iterations still count)
        return steps(path) is not None
    if loc is None:
        return False
    config = os.path.join(loc.folder, CONFIG_FILE)
    if not os.path.isfile(config):
        return True  # marked by a tracker, an iteration folder, common.pt or Bridge/NeMo files
    try:
        data = json_text.loads(read_bytes(config), config)
    except FormatError:
        return True  # `open` names the damage
    return not isinstance(data, dict) or "sharded_backend" in data


def _backend(folder: str, *, strict: bool):
    """`metadata.json`'s sharded_backend (None when the file is missing and not `strict`)."""
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        if not strict:
            return None
        dcp_md = os.path.join(folder, METADATA)
        written = "its .metadata is there" if os.path.isfile(dcp_md) else "no .metadata either"
        raise FormatError(
            f"{folder}: no {CONFIG_FILE}: an unfinished Megatron save (it is written last; "
            f"{written}); use an earlier iteration or finish the save"
        )
    try:
        data = json_text.loads(read_bytes(path), path)  # one line: unreadable, malformed, too deep
    except FormatError:
        if not strict:
            return None
        raise
    if not isinstance(data, dict):
        if not strict:
            return None
        raise FormatError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data.get("sharded_backend")


def check_backend(folder: str) -> None:
    """`metadata.json` is there and names the torch_dist backend (one-line FormatError else)."""
    backend = _backend(folder, strict=True)
    if backend != BACKEND:
        raise FormatError(
            f"{os.path.join(folder, CONFIG_FILE)}: sharded_backend is {backend!r}; only "
            f"{BACKEND!r} checkpoints are read (the zarr backend is retired in Megatron-Core)"
        )
