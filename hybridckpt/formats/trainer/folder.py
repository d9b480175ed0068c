"""What a transformers Trainer / accelerate checkpoint folder holds beside the weights.

Layout (huggingface/transformers: src/transformers/trainer.py `_save_checkpoint`,
`_save_optimizer_and_scheduler`, `_save_rng_state`; huggingface/accelerate:
src/accelerate/checkpointing.py `save_accelerator_state`, utils/fsdp_utils.py `save_fsdp_model`,
`save_fsdp_optimizer`; utils/constants.py names):

- `output_dir/checkpoint-N/` per save; `output_dir/config.json` where the training script saved
  the config (the Trainer writes `checkpoint-N/config.json` only when it saves the model with
  `save_pretrained`: plain, DeepSpeed and FSDP `FULL_STATE_DICT`, not FSDP `SHARDED_STATE_DICT`).
- `trainer_state.json` (`TrainerState`: `global_step`, `log_history` with each logged
  `learning_rate`, `max_steps`, ...), `scheduler.pt` (torch's `LRScheduler.state_dict()`:
  `_last_lr`, `base_lrs`, `last_epoch`), `rng_state[_R].pth`, `training_args.bin` (a pickled
  `TrainingArguments`: `learning_rate`, `weight_decay`, `adam_beta1/2`, `adam_epsilon`).
- accelerate's `save_state`: the same model and optimizer files under its names, with
  `scheduler.bin` and `random_states_R.pkl`.
- The model and optimizer (`layout`): FSDP `SHARDED_STATE_DICT` writes `pytorch_model_fsdp_K/`
  and `optimizer_K/` DCP folders (`{"model": sd}` and `{"optimizer": osd}`, so keys
  `model.<fqn>`, `optimizer.state.<fqn>.<slot>`, `optimizer.param_groups.G.<key>`); FSDP
  `FULL_STATE_DICT` writes `pytorch_model_fsdp_K.bin` (accelerate) or `model.safetensors`
  (the Trainer's save_pretrained) and `optimizer_K.bin` (a torch.save of the name-keyed
  optimizer state dict); DeepSpeed writes `latest` + `global_stepN/`; without either,
  `model.safetensors` / `pytorch_model.bin` and `optimizer.pt` (Trainer) or `optimizer.bin`
  (accelerate), a torch optimizer state dict keyed by parameter index.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.pickle.allow import Policy, Stub
from hybridckpt.errors import FormatError, HybridCkptError
from hybridckpt.io.config_file import read_json
from hybridckpt.io.step_folders import StepFolders, StepPattern, listing

TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
SCHEDULERS = ("scheduler.pt", "scheduler.bin")
# accelerate's names (utils/constants.py FSDP_MODEL_NAME, OPTIMIZER_NAME): SHARDED_STATE_DICT
# folders `pytorch_model_fsdp_K/`, `optimizer_K/`; FULL_STATE_DICT files `pytorch_model_fsdp.bin`,
# `optimizer.bin` for the first model (K = 0), `..._K.bin` for the others
FSDP_MODEL_RE = re.compile(r"^pytorch_model_fsdp(_\d+)?(\.bin)?$")
FSDP_OPTIM_RE = re.compile(r"^optimizer_\d+$|^optimizer(_\d+)?\.bin$")
PER_RANK_RE = re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+_rank\d+\.bin$")
PLAIN_OPTIMIZERS = ("optimizer.pt", "optimizer.bin")
PLAIN_MODELS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# a pickled TrainingArguments names transformers' (and accelerate's) classes: inert stubs
ARGS_POLICY = Policy(stub_prefixes=("transformers.", "accelerate."))
CHECKPOINT_DIRS = StepPattern("checkpoint-")  # Trainer._save_checkpoint: `output_dir/checkpoint-{global_step}`
# TrainingArguments fields that are the optimizer's hyper-parameters (transformers'
# `get_optimizer_cls_and_kwargs`: lr, betas, eps; weight decay for the decayed group)
ARGS_HYPER = {"learning_rate": "lr", "weight_decay": "weight_decay", "adam_epsilon": "eps"}


def names(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def layout(folder: str) -> str | None:
    """Which model/optimizer files the folder holds: "fsdp-sharded", "fsdp-full", "deepspeed",
    "plain", or None when it is no Trainer / accelerate checkpoint."""
    have = names(folder)
    fsdp_models = [n for n in have if FSDP_MODEL_RE.match(n)]
    if fsdp_models or any(FSDP_OPTIM_RE.match(n) and os.path.isdir(os.path.join(folder, n)) for n in have):
        sharded = any(os.path.isdir(os.path.join(folder, n)) for n in fsdp_models)
        return "fsdp-sharded" if sharded else "fsdp-full"
    if any(PER_RANK_RE.match(n) for n in have):
        return "fsdp-per-rank"
    marks = TRAINER_STATE in have or any(n.startswith("random_states_") for n in have)
    if not marks:
        return None
    if "latest" in have:
        return "deepspeed"
    if any(n in have for n in PLAIN_MODELS) and any(n in have for n in PLAIN_OPTIMIZERS):
        return "plain"  # (a weights-only save is an HF folder; PaddleFormers' unified one has neither)
    return None


def checkpoint_folders(path: str) -> StepFolders:
    """The `checkpoint-N` folders of an output folder that hold a Trainer checkpoint (`layout`:
    names only), by N; the default is the latest (transformers' `get_last_checkpoint`)."""
    return listing(path, CHECKPOINT_DIRS, lambda f: layout(f) is not None)


def steps(path: str) -> StepFolders | None:
    """An output folder's `checkpoint-N` folders (`io.step_folders`), or None when `path` is a
    checkpoint folder itself or holds none."""
    path = os.path.abspath(path)
    if not os.path.isdir(path) or layout(path) is not None:
        return None
    found = checkpoint_folders(path)
    return found if found.folders else None


def detect(path: str) -> bool:
    """A Trainer / accelerate checkpoint folder (`layout`) or an output folder of them (`steps`):
    names only. Here, not in `reader`, so that detection imports no weights reader."""
    if not os.path.isdir(path):
        return False
    return layout(path) is not None or steps(path) is not None


@dataclass(frozen=True)
class TrainerFiles:
    """The metadata beside the weights (each absent part None / empty)."""

    step: int | None
    lr: float | None  # the scheduler's current learning rate (`_last_lr[0]`), else the last logged
    lrs: tuple[float, ...]  # the scheduler's per-group learning rates
    args_hyper: Mapping[str, object]  # from training_args.bin, under torch's names
    state: Mapping[str, object]  # trainer_state.json fields worth keeping (JSON)
    notes: tuple[str, ...]


def read_trainer_files(folder: str) -> TrainerFiles:
    notes: list[str] = []
    step = None
    logged_lr = None
    kept: dict = {}
    ts_path = os.path.join(folder, TRAINER_STATE)
    if os.path.isfile(ts_path):
        ts = read_json(ts_path)
        gs = ts.get("global_step")
        if gs is not None and (not isinstance(gs, int) or isinstance(gs, bool) or gs < 0):
            raise FormatError(f"{ts_path}: global_step: expected a non-negative integer, found {gs!r}")
        step = gs
        kept = {k: ts[k] for k in ("epoch", "max_steps", "train_batch_size", "total_flos") if k in ts}
        history = ts.get("log_history")
        if isinstance(history, list):
            lrs = [h["learning_rate"] for h in history if isinstance(h, Mapping)
                   and isinstance(h.get("learning_rate"), (int, float)) and not isinstance(h.get("learning_rate"), bool)]
            logged_lr = float(lrs[-1]) if lrs else None
    lrs: tuple[float, ...] = ()
    for name in SCHEDULERS:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            lrs = _scheduler_lrs(path)
            break
    args_hyper = _training_args(os.path.join(folder, TRAINING_ARGS), notes)
    lr = lrs[0] if lrs else logged_lr
    return TrainerFiles(step, lr, lrs, args_hyper, kept, tuple(notes))


def _scheduler_lrs(path: str) -> tuple[float, ...]:
    """`_last_lr` of a torch LRScheduler state dict (the learning rate of each param group now)."""
    sd = torch_save.load(path)
    if not isinstance(sd, Mapping):
        raise FormatError(f"{path}: expected a scheduler state dict, found {type(sd).__name__}")
    last = sd.get("_last_lr")
    if last is None:
        return ()
    if not isinstance(last, (list, tuple)) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in last
    ):
        raise FormatError(f"{path}: _last_lr: expected a list of numbers, found {str(last)[:80]}")
    return tuple(float(x) for x in last)


def _training_args(path: str, notes: list[str]) -> dict:
    """The optimizer fields of a pickled `TrainingArguments` (read as an inert stub)."""
    if not os.path.isfile(path):
        return {}
    try:
        obj = torch_save.load(path, policy_extra=ARGS_POLICY)
    except HybridCkptError as e:
        notes.append(f"{path}: not read ({str(e)[:120]})")
        return {}
    if not isinstance(obj, Stub):
        notes.append(f"{path}: not a pickled TrainingArguments ({type(obj).__name__}); not read")
        return {}
    fields = {k: getattr(obj, k, None) for k in (*ARGS_HYPER, "adam_beta1", "adam_beta2", "optim")}
    out: dict = {}
    for src, dst in ARGS_HYPER.items():
        v = fields.get(src)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[dst] = float(v)
    b1, b2 = fields.get("adam_beta1"), fields.get("adam_beta2")
    if all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (b1, b2)):
        out["betas"] = [float(b1), float(b2)]
    optim = fields.get("optim")  # an OptimizerNames enum stub, or its string
    optim = optim if isinstance(optim, str) else getattr(optim, "stub_args", (None,))[:1]
    optim = optim[0] if isinstance(optim, tuple) and optim else optim
    if isinstance(optim, str):
        out["optim"] = optim
    return out
