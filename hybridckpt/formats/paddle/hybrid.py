"""`open` for PaddleNLP hybrid-parallel checkpoints (Trainer `checkpoint-<step>/`) and single
`.pdparams` files.

The folder's files (`files.scan`) are read group by group (`groups.read_group`: one (tp, pp)),
sharding pieces stitched (`groups.stitch`), then the tp shards of each structured name merged by
the `tp` statements of the family's TP rules (`rules.tp_rules`, never guessed from shapes). PP:
files hold global single-card names (merge = union; a name saved on two stages is taken once).
bf16 + sharded save drops the params that have master weights (ckpt_converter.py treats files
of at most 512 bytes as "not stored"; here the contents decide): missing params are rebuilt from
the fp32 master weights cast to the model dtype (param_meta, else config.json `dtype`).

Returned names are Paddle structured names (weights `[in, out]`); `hf_rules` (the family's
rules file) maps them to HF names. Optimizer state: the accumulators as slots
(`optimizer.SLOT_OF_ACCUMULATOR`), master weights, the step from the beta pows; the training
step and trainer state from `trainer_state.json`.
"""

from __future__ import annotations

import json
import os

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.pickle import paddle_save
from hybridckpt.errors import FormatError, MappingError
from hybridckpt.formats.paddle.files import MODEL_RE, OPT_RE, as_model_dtype, config_dtype, scan
from hybridckpt.formats.paddle.groups import (
    Group,
    check_strategies,
    piece_layout,
    read_group,
    source_files,
    stitch,
)
from hybridckpt.formats.paddle.optimizer import (
    BETA_POWS,
    SLOT_OF_ACCUMULATOR,
    adam_step,
    scalar,
)
from hybridckpt.formats.paddle.rules import family, hf_rule_vars, load_config, tp_rules
from hybridckpt.io.config_file import read_json
from hybridckpt.lazy import LazyTensor
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "paddle"


def jsonable(x):
    """`x` when JSON can hold it, else its repr (trainer metadata)."""
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return repr(x)


def detect(path: str) -> bool:
    if os.path.isfile(path):
        return path.endswith(".pdparams")
    if not os.path.isdir(path):
        return False
    return any(MODEL_RE.match(f) or OPT_RE.match(f) for f in os.listdir(path))


def _open_file(path: str, config) -> SourceCheckpoint:
    d = paddle_save.read(path)
    folder = os.path.dirname(path) or "."
    tensors = {k: as_model_dtype(t) for k, t in d.tensors.items()}
    cfg = load_config(folder, config)
    if cfg is None:  # one single-card file of an architecture we do not know: its own names
        return SourceCheckpoint(format=NAME, path=path, tensors=tensors,
                                notes=("no known model config: tensors under Paddle's own names",))
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        hf_rules=family(cfg, path).hf_rules,
        rule_vars=hf_rule_vars(cfg, tensors),
        config=cfg,
    )


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """A PaddleNLP checkpoint folder (or one `.pdparams`) as lazy global tensors."""
    if os.path.isfile(path):
        return _open_file(path, config)
    g = scan(path)
    cfg = load_config(path, config)
    fam = family(cfg, path)
    tprules = tp_rules(cfg, g.tp)
    groups = {
        (t, p): read_group(g, t, p, cfg.num_layers, fam.prefix)
        for p in range(g.pp)
        for t in range(g.tp)
    }
    check_strategies(g, groups)
    model_dtype = config_dtype(path)
    notes: list[str] = []

    def local(grp: Group, n: str, kind: str) -> LazyTensor | None:
        """The tp rank's tensor of kind model/<accumulator>/master, sharding pieces stitched."""
        if kind == "model":
            return grp.model[n].tensor if n in grp.model else None
        pieces = grp.states.get(n, {}).get(kind)
        return stitch(n, kind, pieces, grp.shapes.get(n)) if pieces else None

    tensors: dict[str, LazyTensor] = {}
    slots: dict[str, dict[str, LazyTensor]] = {}  # slot name -> structured name -> tensor
    master: dict[str, LazyTensor] = {}
    beta_pows: dict[str, list[float]] = {k: [] for k in BETA_POWS}
    rebuilt = []
    for p in range(g.pp):
        names = dict.fromkeys(n for t in range(g.tp) for n in groups[(t, p)].order)
        for n in names:
            missing = [t for t in range(g.tp) if n not in groups[(t, p)].order]
            if missing:
                raise FormatError(
                    f"{g.folder}: {n!r} is saved by tp rank(s) {sorted(set(range(g.tp)) - set(missing))} "
                    f"of pp stage {p} but not by tp rank(s) {missing}"
                )
            if n in tensors:
                continue  # pipeline: a name saved on two stages (shared layers) is taken once
            per_tp: dict[str, list] = {}
            accumulators = sorted(
                {k for t in range(g.tp) for k in groups[(t, p)].states.get(n, {})}
                & set(SLOT_OF_ACCUMULATOR)
            )
            for kind in ("model", *accumulators, "master"):
                shards = [local(groups[(t, p)], n, kind) for t in range(g.tp)]
                if all(x is None for x in shards):
                    continue
                if any(x is None for x in shards):
                    lack = [t for t, x in enumerate(shards) if x is None]
                    raise FormatError(
                        f"{g.folder}: {n!r} ({kind}) is missing on tp rank(s) {lack} of pp stage {p}"
                    )
                per_tp[kind] = shards
            for t in range(g.tp):
                for kind in beta_pows:
                    pieces = groups[(t, p)].states.get(n, {}).get(kind)
                    if pieces:
                        beta_pows[kind].append(scalar(pieces[min(pieces)].tensor, f"{g.folder}: {n!r} ({kind})"))
            merged = {}
            for kind, shards in per_tp.items():
                try:
                    merged[kind] = tprules.merge_tp(n, shards)
                except (FormatError, MappingError) as e:  # name the files: the rule cannot
                    files = [source_files(groups[(t, p)], n, kind) for t in range(g.tp)]
                    raise FormatError(
                        f"{n!r} ({kind}) of pp stage {p}: the tp shards in {files} do not fit "
                        f"together: {e}"
                    ) from e
            if "model" in merged:
                tensors[n] = merged["model"]
            elif "master" in merged:
                dt = groups[(0, p)].dtypes.get(n) or model_dtype
                if dt is None:
                    dt = np.dtype(np.float32)
                    notes.append(f"{n}: model dtype unknown; kept the fp32 master weight")
                tensors[n] = lazy.cast(merged["master"], dt)
                rebuilt.append(n)
            else:
                raise FormatError(
                    f"{g.folder}: no value for {n!r}: the model_state files do not hold it and the "
                    f"optimizer has no master weight for it"
                )
            for kind in accumulators:
                slots.setdefault(SLOT_OF_ACCUMULATOR[kind], {})[n] = merged[kind]
            if "master" in merged:
                master[n] = merged["master"]
    if rebuilt:
        notes.append(
            f"{len(rebuilt)} params rebuilt from fp32 master weights cast to the model dtype "
            f"(model_state files hold none of them)"
        )
    optimizer = None
    trainer: dict = {}
    first = groups[(0, 0)]
    if first.extra.get("LR_Scheduler") is not None:
        trainer["lr_scheduler"] = jsonable(first.extra["LR_Scheduler"])
    if slots or master:
        step, hyper = adam_step(path, beta_pows, notes)
        optimizer = OptimizerState(slots=slots, step=step, master=master, hyper=hyper)
    global_step = None
    ts = os.path.join(path, "trainer_state.json")
    if os.path.isfile(ts):
        state = read_json(ts)
        global_step = state.get("global_step")
        trainer.update({k: jsonable(v) for k, v in state.items() if k != "log_history"})
    if g.ignored:
        notes.append(f"not read: {', '.join(g.ignored)}")
    strategy = "none"
    if g.sharding > 1:
        flat = any(
            piece_layout(pc, grp.shapes[n]) == "flat"
            for grp in groups.values()
            for n, kinds in grp.states.items()
            if n in grp.shapes and len(grp.shapes[n]) >= 2
            for pieces in kinds.values()
            for pc in pieces.values()
        )
        strategy = "flat (stage1 v2 / stage3)" if flat else "whole (stage1 v1 / stage2)"
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=fam.hf_rules,
        rule_vars=hf_rule_vars(cfg, tensors),
        config=cfg,
        step=global_step if global_step is not None else (optimizer.step if optimizer else None),
        topology={"tp": g.tp, "pp": g.pp, "sharding": g.sharding},
        trainer={**trainer, "sharding_layout": strategy},
        notes=tuple(notes),
    )
