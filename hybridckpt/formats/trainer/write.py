"""The HF Trainer's resume files, written without torch: `export --to hf --optimizer
--optimizer-layout trainer` makes the HF folder a `checkpoint-N/` that
`Trainer.train(resume_from_checkpoint=OUT)` resumes WITH the optimizer's moments.

What transformers 5.24 reads on resume (src/transformers/trainer.py `_load_from_checkpoint`,
`_load_optimizer_and_scheduler`, `_load_rng_state`, `_init_training_state`):

- `model.safetensors` (+ `config.json`): the HF writer's files, as for any export;
- `optimizer.pt`: `torch.optim.AdamW.state_dict()` as `Trainer.create_optimizer` builds the
  optimizer: `{"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [g0, g1]}`, keyed
  by parameter INDEX. g0 holds the parameters the Trainer decays (`optim.trainer_groups`), g1
  the others, both present even when empty, each in `named_parameters()` order, the indices
  running over g0 then g1. Each group carries the source's `lr` (the learning rate of the next
  step: the scheduler has stepped), `betas`, `eps`, `initial_lr` (the scheduler's base), g0 the
  source's `weight_decay` and g1 0.0, and the flags of the Trainer's default optimizer
  (`optim="adamw_torch_fused"`: `fused=True`) unless the source records its own. torch's
  `load_state_dict` takes every group value from the file, so these are what the resumed run
  steps with. `step` is a float32 0-d tensor per parameter (torch's AdamW), its own storage each;
- `scheduler.pt`: the `LambdaLR` state the Trainer's default linear schedule
  (`get_linear_schedule_with_warmup`, `lr_lambdas` functools.partials: `{}`) saves:
  `last_epoch` = the step, `base_lrs` = `initial_lr`, `_last_lr` = `lr`; the resumed scheduler
  keeps its own lambda (the resuming run's schedule) and continues from the step;
- `trainer_state.json`: `TrainerState.load_from_json` (a dataclass built from the keys: only
  fields transformers has had since 4.3x are written): `global_step` = the step (the data loader
  skips that many batches), the source's `epoch`, `max_steps`, `train_batch_size`,
  `logging_steps`/`eval_steps`/`save_steps`, `total_flos` where a Trainer source recorded
  them, else TrainerState's defaults (`train_batch_size` 1): the resumed Trainer logs, evaluates
  and saves on the file's intervals, not its arguments' (as for its own checkpoints; it warns
  where they differ), so the export says which it defaulted;
- not written: `rng_state.pth` (the Trainer resumes without it and logs that reproducibility is
  not guaranteed: we do not know the run's RNG state), `scaler.pt` (read only when present), and
  `training_args.bin` (a pickle of `TrainingArguments`, a class whose fields change between
  transformers versions; nothing on resume reads it, and the resuming run brings its own).

The order of `named_parameters()` is recorded nowhere in a checkpoint; `named_parameters_order`
is the one place that decides it (module doc there). Only AdamW is written (the Trainer's default
optimizer); a source without a step or without lr/betas/eps/weight_decay is refused: the Trainer
would resume with torch's defaults in their place, silently. Tensors are streamed into
`optimizer.pt` (`containers.torch_save_many`) one block at a time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridckpt import values
from hybridckpt.errors import CheckpointError, short_repr
from hybridckpt.lazy import ArrayTensor, LazyTensor
from hybridckpt.optim.trainer_groups import trainer_groups

LAYOUTS = ("safetensors", "trainer")  # `--optimizer-layout`: the HF writer's default, the Trainer's
OPTIMIZER, SCHEDULER, STATE = "optimizer.pt", "scheduler.pt", "trainer_state.json"
SLOTS = ("exp_avg", "exp_avg_sq")  # torch AdamW's per-parameter state, after `step`
NEEDED = ("lr", "betas", "eps", "weight_decay")
# torch 2.13 AdamW's param group keys in its order (torch/optim/adamw.py), as the Trainer's default
# `optim="adamw_torch_fused"` makes them; the source's own values replace these where recorded
TRAINER_ADAMW: dict[str, Any] = {
    "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
    "fused": True, "decoupled_weight_decay": True,
}  # fmt: skip
# TrainerState fields written (all in transformers since 4.3x) and their dataclass defaults, but
# train_batch_size: 1 (None breaks 5.24's `compare_trainer_and_checkpoint_args`, which divides it)
STATE_DEFAULTS: dict[str, Any] = {
    "epoch": 0, "max_steps": 0, "logging_steps": 500, "eval_steps": 500, "save_steps": 500,
    "train_batch_size": 1, "num_train_epochs": 0, "total_flos": 0,
}  # fmt: skip
# the fields the resumed run acts on (its logging, evaluation and save intervals; its batch size
# under `auto_find_batch_size`): a default written for one is said
ACTED_ON = ("logging_steps", "eval_steps", "save_steps", "train_batch_size")


def parameter_order(cfg: Any, names: Sequence[str]):
    """The model's `named_parameters()` order of `names` (HF names, the model's trainable
    parameters), with those of its `nn.LayerNorm` modules (`optim.param_order.ParamOrder`): the
    index order of `optimizer.pt` and the Trainer's no-decay rule. The family's declared order,
    checked against transformers' own modules family by family in tests/optim/test_param_order.py;
    a name it does not place (a transformers 5 MoE model holds its experts fused,
    `mlp.experts.gate_up_proj`, not under the per-expert names of its files; DeepSeek V3's router
    bias is a buffer there) is refused, never guessed: a wrong order loads without a word and steps
    every moment on the wrong parameter."""
    from hybridckpt.errors import MappingError
    from hybridckpt.optim.param_order import named_parameters

    try:
        return named_parameters(cfg, names)
    except MappingError as e:
        raise CheckpointError(f"export --optimizer-layout trainer: the optimizer.pt index order is the model's "
                              f"named_parameters() order, which does not place every exported name: {e}") from None


def named_parameters_order(cfg: Any, names: Sequence[str]) -> list[str]:
    """`parameter_order`'s names."""
    return list(parameter_order(cfg, names).names)


@dataclass(frozen=True)
class TrainerPlan:
    """What the Trainer's files say: the two groups' names (index order: g0 then g1), each
    group's values (no `params`), the step, and notes for the user."""

    decay: tuple[str, ...]
    no_decay: tuple[str, ...]
    groups: tuple[dict, dict]
    step: int
    lr: float
    initial_lr: float
    notes: tuple[str, ...] = ()

    @property
    def order(self) -> tuple[str, ...]:
        return self.decay + self.no_decay


def plan(cfg: Any, names: Sequence[str], hyper: Mapping[str, Any], step: int | None,
         optimizer_name: str | None) -> TrainerPlan:
    """The Trainer's view of the exported params `names` (pure: nothing read). Refused (one
    CheckpointError line) without a model config, when the source's optimizer is not AdamW, has
    no step, or records no lr/betas/eps/weight_decay; a value of the wrong type is a FormatError
    naming it (`values`)."""
    where = "export --optimizer-layout trainer"
    if cfg is None:
        raise CheckpointError(f"{where}: no model config (give --config): optimizer.pt is keyed by the index of "
                              f"each parameter in the model's named_parameters(), which only the model tells")
    if optimizer_name != "adamw":
        raise CheckpointError(f"{where}: the source's optimizer is {optimizer_name!r}; the Trainer's "
                              f"optimizer.pt is written for AdamW (its default) only")
    if step is None:
        raise CheckpointError(f"{where}: the source records no step; the Trainer resumes at trainer_state.json's "
                              f"global_step and AdamW's bias correction needs it")
    missing = [k for k in NEEDED if hyper.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: the source records no {'/'.join(missing)}; expected all of "
                              f"{', '.join(NEEDED)} (the Trainer resumes with optimizer.pt's values, so "
                              f"torch's defaults would silently replace the run's)")
    at = "the source's optimizer hyper-parameters"
    betas = hyper["betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise CheckpointError(f"{where}: the source's betas is {short_repr(betas, 60)}; expected two numbers")
    betas = values.numbers(betas, at, "betas", 2)
    if hyper.get("amsgrad") is not None and values.flag(hyper["amsgrad"], at, "amsgrad"):
        raise CheckpointError(f"{where}: the source's AdamW has amsgrad on; expected off (its max_exp_avg_sq "
                              f"is not carried)")
    flags = {}
    for k in TRAINER_ADAMW:
        if k != "amsgrad" and hyper.get(k) is not None:
            flags[k] = values.flag(hyper[k], at, k)
    lr, wd, eps = (values.number(hyper[k], at, k) for k in ("lr", "weight_decay", "eps"))
    initial = values.number(hyper["initial_lr"], at, "initial_lr") if hyper.get("initial_lr") is not None else lr
    found = parameter_order(cfg, names)
    order = list(found.names)
    decay, no_decay = trainer_groups(order, found.layernorms)  # (the family's declared nn.LayerNorm params)
    groups = tuple({"weight_decay": w, "lr": lr, "betas": (betas[0], betas[1]),  # (a tuple each, as torch's pickle)
                    "eps": eps, **TRAINER_ADAMW, **flags, "initial_lr": initial}
                   for w in (wd, 0.0))
    return TrainerPlan(tuple(decay), tuple(no_decay), groups, int(step), lr, initial,
                       _group_notes(hyper, decay, no_decay, wd))


def _group_notes(hyper: Mapping[str, Any], decay: Sequence[str], no_decay: Sequence[str], wd: float) -> tuple:
    """What the Trainer's grouping changes of the source's: parameters it decayed that the
    Trainer's rule does not (torchtitan decays every parameter), or the reverse."""
    groups = hyper.get("groups")
    if not groups:
        if wd and no_decay:
            return (f"the source records one weight_decay ({wd}) and no param groups; the Trainer's rule puts "
                    f"{len(no_decay)} parameters (biases, norms: {no_decay[0]}, ...) in its no-decay group "
                    f"(weight_decay 0.0), as a Trainer run would",)
        return ()
    at = "the source's param groups"
    decayed = set()
    for i, g in enumerate(values.sequence(groups, at, "groups")):
        g = values.mapping(g, at, f"group {i}")
        if g.get("weight_decay") is not None and values.number(g["weight_decay"], at, f"group {i} weight_decay"):
            decayed |= {str(n) for n in values.sequence(g.get("params") or [], at, f"group {i} params")}
    moved = [n for n in no_decay if n in decayed] + [n for n in decay if n not in decayed and wd]
    return (f"the source's param groups decay {len(moved)} parameter(s) otherwise than the Trainer's rule "
            f"({moved[0]}, ...): written in the Trainer's groups",) if moved else ()


def _optimizer_value(p: TrainerPlan, slots: Mapping[str, Mapping[str, LazyTensor]]):
    """(the state dict with tensor references, their `Tensors`) in torch's key order."""
    from hybridckpt.containers.torch_save_many import Tensors

    refs = Tensors()
    state: dict[int, dict] = {}
    step = np.asarray(float(p.step), dtype=np.float32)
    for i, name in enumerate(p.order):
        state[i] = {"step": refs.ref(ArrayTensor(step.copy()))}
        for s in SLOTS:
            state[i][s] = refs.ref(slots[s][name])
    index = {n: i for i, n in enumerate(p.order)}
    groups = [{**g, "params": [index[n] for n in names]} for g, names in zip(p.groups, (p.decay, p.no_decay),
                                                                             strict=True)]
    return {"state": state, "param_groups": groups}, refs


def scheduler_state(p: TrainerPlan) -> dict:
    """`LambdaLR.state_dict()` of the Trainer's linear schedule after `p.step` steps (torch 2.13
    keys and order; `lr_lambdas` `{}`: a partial's empty `__dict__`)."""
    return {"base_lrs": [p.initial_lr] * 2, "last_epoch": p.step, "_step_count": p.step + 1, "_is_initial": False,
            "_get_lr_called_within_step": False, "_last_lr": [p.lr] * 2, "lr_lambdas": [{}, {}]}


def trainer_state(p: TrainerPlan, trainer: Mapping[str, Any]) -> dict:
    """trainer_state.json: `global_step` = the step, the fields a Trainer source recorded
    (`trainer_state.<field>` in its trainer metadata, numbers only), else the defaults."""
    return _trainer_state(p, trainer)[0]


def state_note(trainer: Mapping[str, Any]) -> tuple[str, ...]:
    """What trainer_state.json holds by default that the resumed run acts on (module doc)."""
    fallback = [k for k in ACTED_ON if k not in _trainer_state(None, trainer)[1]]
    if not fallback:
        return ()
    shown = ", ".join(f"{k} {STATE_DEFAULTS[k]}" for k in fallback)
    return (f"trainer_state.json: {shown}: TrainerState's defaults, the source records none; the resumed "
            f"Trainer logs, evaluates and saves on these, not on its arguments (it warns where they differ)",)


def _trainer_state(p: TrainerPlan | None, trainer: Mapping[str, Any]) -> tuple[dict, set[str]]:
    """(trainer_state.json's object, the fields taken from the source)."""
    out: dict[str, Any] = {"global_step": p.step if p is not None else 0}
    known = set()
    for k, default in STATE_DEFAULTS.items():
        v = trainer.get(f"trainer_state.{k}")
        if isinstance(v, str):  # (the trainer layer keeps some as text)
            try:
                v = float(v) if "." in v or "e" in v else int(v)
            except ValueError:
                v = None
        try:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        except OverflowError:  # (an int of 400 digits)
            ok = False
        if ok and k in ACTED_ON and not v >= 1:
            ok = False  # (an interval or batch size of 0: the Trainer divides by it)
        out[k] = (int(v) if k != "epoch" and k != "total_flos" else float(v)) if ok else default
        if ok:
            known.add(k)
    return {**out, "log_history": [], "best_metric": None, "best_model_checkpoint": None}, known


def check(p: TrainerPlan, slots: Mapping[str, Mapping[str, LazyTensor]]) -> None:
    """Every parameter has both moments (their shapes are the model's: `naming.model_hf` checked
    them): a CheckpointError naming the first that has not."""
    for s in SLOTS:
        have = slots.get(s) or {}
        lost = [n for n in p.order if n not in have]
        if lost:
            raise CheckpointError(f"export --optimizer-layout trainer: no {s} for {lost[0]} ({len(lost)} "
                                  f"parameter(s)); expected AdamW's {' and '.join(SLOTS)} for every parameter")


def _read_ahead(p: TrainerPlan, slots: Mapping[str, Mapping[str, LazyTensor]]) -> dict:
    """The moments read ahead by the reader pool in the order optimizer.pt takes them (index
    order, `exp_avg` then `exp_avg_sq`), within a window of the largest one staged, as the HF
    writer reads its own (`lazy.parallel.Prefetcher`); those copied file to file or read in row
    blocks (over `WRITE_BLOCK_BYTES`) are not read ahead."""
    from hybridckpt import lazy
    from hybridckpt.containers.safetensors_file import WRITE_BLOCK_BYTES
    from hybridckpt.lazy import parallel

    order = [(s, n) for n in p.order for s in SLOTS]
    staged = {k: slots[k[0]][k[1]] for k in order}
    staged = {k: t for k, t in staged.items() if t.nbytes <= WRITE_BLOCK_BYTES and lazy.copy_runs(t) is None}
    window = max((t.nbytes for t in staged.values()), default=0)
    ahead = parallel.Prefetcher(staged, [k for k in order if k in staged], window).tensors()
    return {s: {n: ahead.get((s, n), slots[s][n]) for n in p.order} for s in SLOTS}


def write_files(folder: str, p: TrainerPlan, slots: Mapping[str, Mapping[str, LazyTensor]], trainer: Mapping,
                *, direct_io: bool = True, on_tensor: Callable[[str, int], None] | None = None) -> list[str]:
    """Write optimizer.pt, scheduler.pt, trainer_state.json into `folder` (the export's
    temporary folder); returns their names."""
    from hybridckpt.containers.torch_save_many import Tensors, write_archive
    from hybridckpt.io.sequential_file import SequentialFile

    check(p, slots)
    slots = _read_ahead(p, slots)
    value, refs = _optimizer_value(p, slots)
    names = {id(t): n for s in SLOTS for n, t in slots[s].items()}
    tell = (lambda t: on_tensor(names.get(id(t), "step"), int(t.nbytes))) if on_tensor else None
    with SequentialFile(os.path.join(folder, OPTIMIZER), direct=direct_io) as out:
        write_archive(out, value, refs, name="optimizer", on_tensor=tell)
    with SequentialFile(os.path.join(folder, SCHEDULER), direct=False) as out:
        write_archive(out, scheduler_state(p), Tensors(), name="scheduler")
    with open(os.path.join(folder, STATE), "w") as f:
        json.dump(trainer_state(p, trainer), f, indent=2, sort_keys=True)
        f.write("\n")
    return [OPTIMIZER, SCHEDULER, STATE]


def hf_hook(request, params: Mapping[str, LazyTensor], slots: Mapping[str, Mapping[str, LazyTensor]]):
    """The HF writer's hook (`formats.hf.write.write_export`, `--optimizer-layout trainer`):
    (a function writing the Trainer's files into the temporary folder, notes, the tensors it
    writes). Planned and checked here, before the HF writer creates anything."""
    named = request.named
    p = plan(request.config, list(params), request.hyper, named.step, getattr(named.optimizer, "name", None))
    check(p, slots)

    def more(tmp: str) -> list[str]:
        return write_files(tmp, p, slots, request.trainer, direct_io=request.direct_io, on_tensor=request.progress)

    tensors = [slots[s][n] for n in p.order for s in SLOTS]
    return more, p.notes + state_note(request.trainer), tensors
