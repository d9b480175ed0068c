"""Which folders are FlexCheckpoint folders (`detect`, `steps`): file names only.

A FlexCheckpoint folder holds `{id}.metadata` and `{rank}_{id}.distcp` files; a PaddleFormers
step folder `checkpoint-N/` holds one as `model_state/` (beside `optimizer_state/`,
`master_weight/`); an output folder holds several step folders. Apart from `reader` (and its
pickle machine, Paddle's optimizer names, numpy) so that detection, which `formats.registry`
runs on every source before DCP's, imports only this.
"""

from __future__ import annotations

import os
import re

from hybridckpt.io.step_folders import StepFolders, StepPattern, listing

DISTCP_RE = re.compile(r"^(?P<rank>\d+)_(?P<id>\d+)\.distcp$")
METADATA_RE = re.compile(r"^(?P<id>\d+)\.metadata$")
MODEL, OPTIMIZER, MASTER = "model_state", "optimizer_state", "master_weight"
CHECKPOINT_DIRS = StepPattern("checkpoint-")  # the Trainer's `output_dir/checkpoint-{global_step}/`


def is_flex_folder(path: str) -> bool:
    """A folder holding `{id}.metadata` and `{rank}_{id}.distcp` files."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(METADATA_RE.match(n) for n in names) and any(DISTCP_RE.match(n) for n in names)


def one_step(path: str) -> bool:
    """A step folder (`model_state/` and the rest) or one bare FlexCheckpoint folder."""
    return os.path.isdir(path) and (is_flex_folder(os.path.join(path, MODEL)) or is_flex_folder(path))


def steps(path: str) -> StepFolders | None:
    """A PaddleFormers output folder's `checkpoint-N/` step folders (each with a FlexCheckpoint
    `model_state/`; names only), the latest the default; None for one step folder itself."""
    if not os.path.isdir(path) or one_step(path):
        return None
    found = listing(path, CHECKPOINT_DIRS, lambda f: is_flex_folder(os.path.join(f, MODEL)))
    return found if found.folders else None


def detect(path: str) -> bool:
    return one_step(path) or steps(path) is not None
