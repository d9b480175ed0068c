"""DeepSpeed universal checkpoints (`ds_to_universal` output), read without DeepSpeed.

Layout (deepspeedai/DeepSpeed: deepspeed/checkpoint/ds_to_universal.py `merge_tp_slices`,
`_save_optimizer_state`, constants.py):
- `<save>/latest_universal` holds the tag (`global_stepN_universal`); `<save>/<tag>/` holds
  `mp_rank_TT_model_states.pt` (copies of the source's model states: `param_shapes`,
  `global_steps`, `ds_config`, `checkpoint_parallel_dimensions`, ...) and `zero/`.
- `zero/<param name>/{fp32,exp_avg,exp_avg_sq}.pt`: each a torch.save of a dict with `param`
  (the WHOLE tensor: the ZeRO partitions joined, the tensor-parallel slices merged along
  `cat_dim`, vocabulary padding stripped for `vocab_tensor` params) and the keys that say how to
  cut it again for a tensor-parallel degree: `cat_dim` (the dim the TP slices were
  concatenated on), `param_n_sub_params` (2: a fused [a; b] param whose halves are cut
  separately), `sub_param_shape`, `vocab_tensor`; a replicated or averaged param has no
  `cat_dim`. `zero/<name>/step.pt`: a 0-d tensor (or number), the optimizer's step.
- `zero/optimizer_state.pt`: the ZeRO optimizer state dict without its shards: `param_groups`
  (lr, betas, eps, weight_decay; `params` are indices), `zero_stage`, `partition_count`, ...

Names are the module's (HF names for HF models); the step is the per-param `step` (all equal).
The cut keys are kept per tensor in `trainer["universal_cut"]` (what a loader at another TP
degree needs); the tensors themselves are already whole.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError, short_repr
from hybridckpt.formats.deepspeed.files import file_names, tag_steps
from hybridckpt.io.config_file import config_beside, read_small_text
from hybridckpt.io.paths import inside
from hybridckpt.io.step_folders import StepFolders, StepPattern
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim import torch_optim
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "deepspeed-universal"
LATEST = "latest_universal"
TAG_DIRS = StepPattern("global_step", "_universal")  # ds_to_universal's `global_step{N}_universal`
ZERO = "zero"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
CUT_KEYS = ("cat_dim", "param_n_sub_params", "sub_param_shape", "vocab_tensor")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def _is_universal(folder: str) -> bool:
    zero = os.path.join(folder, ZERO)
    return os.path.isdir(zero) and (
        os.path.isfile(os.path.join(zero, "optimizer_state.pt"))
        or any(os.path.isfile(os.path.join(zero, n, "fp32.pt")) for n in file_names(zero)[:8])
    )


def tag_dir(path: str) -> str:
    """The universal folder: `path` itself, or the tag `path/latest_universal` names."""
    if _is_universal(path):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        tag = read_small_text(latest)
        folder = inside(path, tag, latest, "tag")
        if not _is_universal(folder):
            raise FormatError(f"{latest}: names tag {tag!r}, but {folder} holds no universal checkpoint (zero/)")
        return folder
    raise FormatError(f"{path}: no {LATEST} and no zero/<param>/fp32.pt")


def steps(path: str) -> StepFolders | None:
    """A save folder's `global_stepN_universal` folders, `latest_universal`'s the default."""
    return tag_steps(path, TAG_DIRS, LATEST, _is_universal)


def detect(path: str) -> bool:
    """A universal folder, or a save folder with `latest_universal` and no ZeRO `latest` (with
    both, the plain ZeRO checkpoint is read; `--format deepspeed-universal` picks this one)."""
    if not os.path.isdir(path):
        return False
    if _is_universal(path):
        return True
    return os.path.isfile(os.path.join(path, LATEST)) and not os.path.isfile(os.path.join(path, "latest"))


def _state_file(path: str) -> tuple[LazyTensor, dict]:
    """(`param`, the cut keys) of one `<state>.pt`."""
    d = torch_save.load(path)
    if not isinstance(d, Mapping) or not isinstance(d.get("param"), LazyTensor):
        raise FormatError(f"{path}: expected a dict with a 'param' tensor, found {short_repr(d)}")
    cut = {}
    for k in CUT_KEYS:
        if k in d:
            v = d[k]
            if k == "sub_param_shape":
                v = str(v)[:200]  # a SubparamShape stub: recorded as text
            elif not isinstance(v, (int, bool)):
                raise FormatError(f"{path}: {k}: expected an int, found {short_repr(v)}")
            cut[k] = v
    cat = cut.get("cat_dim")
    if cat is not None and not 0 <= cat < max(1, d["param"].ndim):
        raise FormatError(f"{path}: cat_dim {cat} outside the param's {d['param'].ndim} dims")
    return d["param"], cut


def _step(path: str) -> float | None:
    if not os.path.isfile(path):
        return None
    v = torch_save.load(path)
    if isinstance(v, LazyTensor):
        if v.shape != ():
            raise FormatError(f"{path}: a step is 0-d, found shape {v.shape}")
        return float(v.materialize())
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise FormatError(f"{path}: expected a number, found {short_repr(v)}")


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = tag_dir(os.path.abspath(path))
    zero = os.path.join(folder, ZERO)
    names = [n for n in file_names(zero) if os.path.isdir(os.path.join(zero, n))]
    if not names:
        raise FormatError(f"{zero}: no parameter folders")
    tensors: dict[str, LazyTensor] = {}
    slots: dict[str, dict[str, LazyTensor]] = {}
    cuts: dict[str, dict] = {}
    steps: dict[str, float] = {}
    for n in names:
        d = os.path.join(zero, n)
        if not os.path.isfile(os.path.join(d, "fp32.pt")):
            raise FormatError(f"{d}: no fp32.pt")
        tensors[n], cut = _state_file(os.path.join(d, "fp32.pt"))
        if cut:
            cuts[n] = cut
        for s in STATES[1:]:
            p = os.path.join(d, f"{s}.pt")
            if os.path.isfile(p):
                t, _ = _state_file(p)
                if tuple(t.shape) != tuple(tensors[n].shape):
                    raise FormatError(f"{p}: shape {tuple(t.shape)}, but fp32.pt's is {tuple(tensors[n].shape)}")
                slots.setdefault(s, {})[n] = t
        step = _step(os.path.join(d, "step.pt"))
        if step is not None:
            steps[n] = step
    torch_optim.check_complete(slots, zero)
    notes = ["DeepSpeed universal checkpoint: whole fp32 params and moments per parameter (zero/<name>/)"]
    hyper: dict = {}
    trainer: dict = {}
    opt_path = os.path.join(zero, "optimizer_state.pt")
    if os.path.isfile(opt_path):
        osd = torch_save.load(opt_path)
        groups = osd.get("param_groups") if isinstance(osd, Mapping) else None
        if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups):
            hyper = torch_optim.hyper(groups, _group_names(folder, len(groups)), opt_path)
    models = sorted(n for n in file_names(folder) if MODEL_RE.match(n))
    if models:
        m0 = torch_save.load(os.path.join(folder, models[0]))
        if isinstance(m0, Mapping):
            trainer = {k: m0[k] for k in ("global_steps", "global_samples", "ds_version", "dp_world_size", "mp_world_size")
                       if isinstance(m0.get(k), (int, str)) and not isinstance(m0.get(k), bool)}
            dims = m0.get("checkpoint_parallel_dimensions")
            if isinstance(dims, Mapping):
                trainer["source_parallel"] = {k: v for k, v in dims.items() if isinstance(k, str) and isinstance(v, int)}
    if cuts:
        trainer["universal_cut"] = cuts
    values = set(steps.values())
    step = int(max(values)) if values else None
    if len(values) > 1:
        notes.append(f"params have different optimizer steps {sorted(values)[:5]}; using {step}")
    optimizer = OptimizerState(slots, step, hyper=hyper) if slots else None
    src_tp = trainer.get("source_parallel", {}).get("tp_degree")
    return SourceCheckpoint(
        NAME, path, tensors, optimizer=optimizer,
        config=config_beside(folder, os.path.dirname(folder), os.path.dirname(os.path.dirname(folder)), config=config),
        step=trainer.get("global_steps", step), topology={"tp": src_tp} if isinstance(src_tp, int) else {},
        trainer=trainer, notes=tuple(notes),
    )


def _group_names(folder: str, n_groups: int) -> list[list[str]]:
    """Each param group's names, from the model states' `param_shapes` (one ordered dict per group)."""
    models = sorted(n for n in file_names(folder) if MODEL_RE.match(n))
    if not models:
        return [[] for _ in range(n_groups)]
    m0 = torch_save.load(os.path.join(folder, models[0]))
    shapes = m0.get("param_shapes") if isinstance(m0, Mapping) else None
    if not isinstance(shapes, list) or len(shapes) != n_groups or not all(isinstance(g, Mapping) for g in shapes):
        return [[] for _ in range(n_groups)]
    return [[k for k in g if isinstance(k, str)] for g in shapes]
