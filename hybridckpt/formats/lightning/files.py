"""Which paths are Lightning checkpoints, and the steps of a folder of them (names and pickles only).

Lightning (lightning 2.6: `pytorch/trainer/connectors/checkpoint_connector.py`
`dump_checkpoint`, `pytorch/strategies/fsdp.py` `save_checkpoint`) writes a checkpoint as:
- a `.ckpt` FILE: `torch.save` of a dict `{"epoch", "global_step", "pytorch-lightning_version",
  "state_dict", "loops", "callbacks", "optimizer_states", "lr_schedulers", ...}`; told apart from
  any torch file by its pickle alone (`is_lightning_file`: the key strings first, then the
  top-level dict's keys through the restricted unpickler; no tensor byte read);
- a `.ckpt/` FOLDER (`FSDPStrategy(state_dict_type="sharded")`): a torch DCP folder of
  `{"model": <state_dict>, "optimizer_0": ..., ...}` with `meta.pt` beside the shards (the rest of
  the dict above, written by rank 0).
`ModelCheckpoint` names them from its `filename` (default `epoch={epoch}-step={step}`, with
`-v1` for a name taken); a folder of several is read by the `step=N` in their names
(`steps`), the latest by default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hybridckpt.errors import FormatError, HybridCkptError, short_repr
from hybridckpt.io.step_folders import MAX_DIGITS, StepFolders, StepPattern

META = "meta.pt"  # Lightning's own state beside the DCP shards (`_METADATA_FILENAME`)
VERSION = "pytorch-lightning_version"
STATE = "state_dict"
MARKS = (VERSION, "optimizer_states", "global_step")  # with STATE, the keys of a Lightning dict
SUFFIX = ".ckpt"
MAX_ENTRIES = 4096  # a folder with more entries is not listed as a folder of checkpoints
# What a Lightning dict pickles beside tensors and plain values: `hyper_parameters` (the
# LightningModule's `save_hyperparameters()`: an HF config object, an omegaconf `DictConfig` and
# its type), callback and loop state of Lightning's and torchmetrics' classes. They become inert
# stubs (nothing imported or run; none of them is read); any other class stays refused.
STUB_PREFIXES = ("lightning.", "pytorch_lightning.", "lightning_fabric.", "omegaconf.", "transformers.", "torchmetrics.")


def _load(path: str) -> object:
    """`torch_save.load` of `path` under the stubs above (the pickle machinery imported here, on
    the first read: detecting a folder that holds no `.ckpt` loads none of it)."""
    from hybridckpt.containers.pickle import torch_save
    from hybridckpt.containers.pickle.allow import Policy

    return torch_save.load(path, policy_extra=Policy(stub_prefixes=STUB_PREFIXES))


_STEP = re.compile(rf"(?:^|[-_])step=(\d{{1,{MAX_DIGITS}}})(?=$|[-_.])")


class CkptNames(StepPattern):
    """`ModelCheckpoint`'s names: `<anything>step=N<anything>.ckpt` (`epoch=0-step=3.ckpt`,
    `step=3-v1.ckpt`); the step is the ASCII digits after `step=`."""

    def __init__(self):
        super().__init__("step=", SUFFIX)

    def number(self, name: str) -> int | None:
        if not name.endswith(SUFFIX):
            return None
        m = _STEP.search(name[: -len(SUFFIX)])
        return int(m.group(1)) if m and m.group(1).isascii() else None

    @property
    def shape(self) -> str:
        return "*step=N*.ckpt"


def looks_lightning(obj: object) -> bool:
    """A top-level dict with `state_dict` and one of Lightning's own keys."""
    return isinstance(obj, Mapping) and STATE in obj and any(k in obj for k in MARKS)


def is_lightning_file(path: str) -> bool:
    """A torch.save zip file whose object is a Lightning checkpoint dict (module doc)."""
    if not os.path.isfile(path):
        return False
    # (a file: here, not at the module's import)
    from hybridckpt.containers.pickle import torch_save

    if not torch_save.is_torch_zip(path):
        return False
    try:
        pkl = torch_save.zip_pickle(path)
        if pkl is None or STATE.encode() not in pkl or not any(k.encode() in pkl for k in MARKS):
            return False
        return looks_lightning(_load(path))
    except HybridCkptError:
        return False


def is_sharded_folder(path: str) -> bool:
    """A DCP folder with Lightning's `meta.pt` beside its shards."""
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, META))):
        return False
    # (DCP's reader loads the pickle machinery)
    from hybridckpt.formats.dcp.storage import detect as dcp_detect

    return dcp_detect(path)


def holds(path: str) -> bool:
    """`path` is one Lightning checkpoint: a `.ckpt` file or a sharded `.ckpt/` folder."""
    return is_sharded_folder(path) or is_lightning_file(path)


def steps(path: str) -> StepFolders | None:
    """The checkpoints of a folder of several (`*step=N*.ckpt`, files or sharded folders), or
    None when `path` is one checkpoint itself or holds none. Names only, but the latest one is
    opened (`holds`) so a folder of other `.ckpt` files is not taken for Lightning's."""
    if not os.path.isdir(path) or is_sharded_folder(path):
        return None
    try:
        with os.scandir(path) as it:
            names = sorted(e.name for _, e in zip(range(MAX_ENTRIES + 1), it, strict=False))
    except OSError:
        return None
    if len(names) > MAX_ENTRIES:
        return None
    pattern = CkptNames()
    named: dict[int, list[str]] = {}
    for name in names:
        step = pattern.number(name)
        if step is not None:
            named.setdefault(step, []).append(name)
    if not named:
        return None
    latest = max(named)
    if not any(holds(os.path.join(path, n)) for n in named[latest]):
        return None
    folders = {s: os.path.join(path, n[0]) for s, n in named.items()}
    duplicates = {s: tuple(n) for s, n in named.items() if len(n) > 1}
    return StepFolders(os.path.abspath(path), pattern, folders, (), duplicates, latest, "the latest")


def detect(path: str) -> bool:
    return holds(path) or steps(path) is not None


def load_dict(path: str, what: str) -> Mapping:
    """The torch.save dict of `path` (a `.ckpt` file or `meta.pt`), tensors lazy; a FormatError
    naming the file when it is not a torch file or not a dict."""
    if not os.path.isfile(path):
        raise FormatError(f"{path}: missing ({what})")
    obj = _load(path)  # (a FormatError naming the file when it is not a torch.save file)
    if not isinstance(obj, Mapping):
        raise FormatError(f"{path}: expected a dict ({what}), found {type(obj).__name__}")
    for k in obj:
        if not isinstance(k, str):
            raise FormatError(f"{path}: key {short_repr(k)}: expected a str key ({what})")
    return obj
