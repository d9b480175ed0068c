"""`open` of FlexCheckpoint folders (`folders`: `detect`): PaddleFormers 1.x `checkpoint-N/` (the
default `save_checkpoint_format="flex_checkpoint"`), or one bare `dist.save_state_dict` folder.

A Trainer step folder (PaddlePaddle/PaddleFormers: paddleformers/trainer/trainer.py and
trainer/utils/flex_async_save.py `FlexAsyncSaver._plan`) holds three sibling FlexCheckpoints:
- `model_state/`: `model.sharded_state_dict()` under HF names; Linear weights in Paddle's
  `[in, out]` layout (mapped to HF by the family's flex_checkpoint dialect, `hf_rules`),
  embeddings `[vocab, hidden]`;
  dtype as trained (bf16 params stay bf16: each tensor's dtype is its own metadata's, never the
  optimizer's, which Paddle #76538 had to fix for loads of both at once);
- `optimizer_state/`: `optimizer.sharded_state_dict(...)` minus the `.w_0` keys:
  `<name>.moment1_0`, `<name>.moment2_0` (fp32, the weight's layout and shape),
  `<name>.beta1_pow_acc_0`, `<name>.beta2_pow_acc_0` (`[1]`, beta ** (step + 1)), or
  `<name>.velocity_0` (Momentum) (paddle/optimizer/adamw.py `sharded_state_dict`; sharding
  stage1 v2 `DygraphShardingOptimizerV2.sharded_state_dict` and stage3
  `GroupShardedStage3._sharded_state_dict` store moments and masters flattened);
- `master_weight/`: `<name>.w_0`, the fp32 master weights of bf16/fp16 training: imported in
  place of the 16-bit params (`naming.source_named`), the params keeping their own dtype;
- beside them `scheduler.pdparams` (`{last_epoch, last_lr}`), `trainer_state.json` or
  `trainer_state.bin` (a pickled TrainerState, read as a stub), `training_args.bin` (a pickled
  TrainingArguments: `adam_beta1/2` for the step), `rng_state_*.pth`, `saved_signal_*`; no
  `config.json` (the output folder above has it, else `--config`).
Model params missing from `model_state/` (PaddleNLP's zero-cost checkpoint drops those that have
masters) are rebuilt from the masters cast to the model dtype (config `dtype`, else the other
params'). A tied model's state is saved under `lm_head.weight` (`retie`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import numpy as np

from hybridckpt import lazy, models
from hybridckpt.containers.pickle.allow import Stub
from hybridckpt.containers.pickle.machine import safe_load_file
from hybridckpt.errors import FormatError, HybridCkptError
from hybridckpt.formats.flex_checkpoint.folders import (  # noqa: F401 - detect, steps: the format contract
    CHECKPOINT_DIRS,
    DISTCP_RE,
    MASTER,
    METADATA_RE,
    MODEL,
    OPTIMIZER,
    detect,
    steps,
)
from hybridckpt.formats.flex_checkpoint.metadata import DTYPES, FLEX_POLICY, read_metadata
from hybridckpt.formats.flex_checkpoint.storage import open_tensors
from hybridckpt.formats.paddle.optimizer import (
    BETA_POWS,
    DEFAULT_BETAS,
    SLOT_OF_ACCUMULATOR,
    optimizer_step,
    scalar,
)
from hybridckpt.io.config_file import config_beside, read_json
from hybridckpt.lazy import LazyTensor
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "flex-checkpoint"
DIALECT = "flex_checkpoint"  # models/<family>/dialects/flex_checkpoint.{py,rules}
CATCH_ALL = "* -> *"  # every tensor no family rule names is stored as HF stores it
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_STATE_RE = re.compile(r"^(?P<name>.+)\.(?P<acc>[a-z0-9_]+?)_(?P<n>\d+)$")


def hf_rules(cfg, notes: list[str]) -> str:
    """The rules from the model_state's names and layouts to HF's: the flex_checkpoint dialect of
    `cfg`'s family (the nn.Linear weights it transposes), then `CATCH_ALL`. Without a config, or
    for a family without that dialect, every family's dialect at once (the Linear weights any of
    them names; they agree where they share names), noted."""
    fam = models.family_of(cfg) if cfg is not None else None
    own = fam.dialect(DIALECT) if fam is not None else None
    if own is not None:
        return f"{own.rules_text()}\n{CATCH_ALL}\n"
    texts = {}
    for d in models.dialects(DIALECT).values():
        text, origin = d.rules()
        texts.setdefault(origin, text)
    why = "no model config" if fam is None else f"{fam.name} has no flex_checkpoint dialect"
    notes.append(
        f"{why}: the nn.Linear weights every family's flex_checkpoint dialect names are "
        f"transposed ({' + '.join(texts)})"
    )
    return "\n".join([*texts.values(), CATCH_ALL, ""])


def _scalar_fields(obj) -> dict:
    """The JSON-able scalar fields of a stub (a pickled TrainerState) or a dict."""
    items = (
        vars(obj).items() if isinstance(obj, Stub) else obj.items() if isinstance(obj, dict) else ()
    )
    return {
        k: v
        for k, v in items
        if isinstance(k, str)
        and not k.startswith("stub_")
        and isinstance(v, (int, float, str, bool))
    }


def _read_pickle(path: str, notes: list[str]):
    """A small pickle beside the checkpoint under FLEX_POLICY, or None (and a note)."""
    if not os.path.isfile(path):
        return None
    try:
        return safe_load_file(path, FLEX_POLICY)
    except HybridCkptError as e:
        notes.append(f"not read: {os.path.basename(path)} ({e})")
        return None


def trainer_state(folder: str, notes: list[str]) -> dict:
    """trainer_state.json (or the pickled trainer_state.bin) and scheduler.pdparams."""
    out: dict = {}
    js = os.path.join(folder, "trainer_state.json")
    if os.path.isfile(js):
        out.update(_scalar_fields(read_json(js)))
    else:
        out.update(
            _scalar_fields(_read_pickle(os.path.join(folder, "trainer_state.bin"), notes) or {})
        )
    sched = _read_pickle(os.path.join(folder, "scheduler.pdparams"), notes)
    if sched is not None:
        out.update({f"lr_scheduler.{k}": v for k, v in _scalar_fields(sched).items()})
    return out


def betas(folder: str, notes: list[str]) -> tuple[tuple[float, float], bool]:
    """(AdamW's betas, whether they were read): `adam_beta1` / `adam_beta2` of
    training_args.bin, else Paddle's defaults."""
    args = _read_pickle(os.path.join(folder, "training_args.bin"), notes)
    b1, b2 = (
        (getattr(args, f"adam_beta{i}", None) for i in (1, 2)) if args is not None else (None, None)
    )
    if isinstance(b1, float) and isinstance(b2, float):
        return (b1, b2), True
    return DEFAULT_BETAS, False


def adam_step(
    folder: str, pows: dict[str, list[float]], notes: list[str]
) -> tuple[int | None, list]:
    """(the step, the betas) from the beta pow accumulators. With the run's betas (from
    training_args.bin) as `optimizer_step` reads them; with Paddle's defaults assumed, only when
    beta1's and beta2's accumulators both give the same step (a wrong beta2 alone can look like
    a whole number of steps: 0.95 ** 4 reads as 204 steps of 0.999)."""
    b, read = betas(folder, notes)
    step = optimizer_step(pows["beta1_pow_acc"], pows["beta2_pow_acc"], b, betas_read=read)
    if step is None:
        notes.append(
            f"optimizer step unknown: the beta pow accumulators are not powers of the betas {b}"
            + ("" if read else " (Paddle's defaults; training_args.bin gives none)")
        )
        return None, []
    if not read:
        notes.append(f"optimizer step derived assuming betas {b} (Paddle's defaults)")
    return step, list(b)


def _split_optimizer(tensors: dict[str, LazyTensor], where: str, notes: list[str]):
    """(slots, beta pow values, unknown keys) of the optimizer_state tensors."""
    slots: dict[str, dict[str, LazyTensor]] = {}
    pows: dict[str, list[float]] = {k: [] for k in BETA_POWS}
    unknown = []
    for key, t in tensors.items():
        m = _STATE_RE.match(key)
        acc = m.group("acc") if m else None
        if acc in SLOT_OF_ACCUMULATOR:
            slots.setdefault(SLOT_OF_ACCUMULATOR[acc], {})[m.group("name")] = t
        elif acc in BETA_POWS:
            if t.size != 1:
                raise FormatError(f"{where}: {key!r} has shape {t.shape}, expected [1]")
            pows[acc].append(scalar(t))
        else:
            unknown.append(key)
    if unknown:
        notes.append(f"optimizer_state keys not read: {sorted(unknown)[:5]}")
    return slots, pows


def _model_dtype(cfg, tensors: dict[str, LazyTensor]) -> np.dtype | None:
    dt = getattr(cfg, "dtype", None) if cfg is not None else None
    if isinstance(dt, str) and dt in DTYPES:
        return DTYPES[dt]
    kinds = {np.dtype(t.dtype) for t in tensors.values() if np.dtype(t.dtype).kind == "f"}
    return kinds.pop() if len(kinds) == 1 else None


def _config_dtype(folders: list[str]) -> np.dtype | None:
    for f in folders:
        path = os.path.join(f, "config.json")
        if os.path.isfile(path):
            doc = read_json(path)
            dt = doc.get("dtype") or doc.get("torch_dtype")
            return DTYPES.get(dt) if isinstance(dt, str) else None
    return None


def retie(
    tensors: dict[str, LazyTensor],
    slots: dict[str, dict[str, LazyTensor]],
    master: dict[str, LazyTensor],
    notes: list[str],
) -> None:
    """A tied model as PaddleFormers saves it, put right in place: `model.sharded_state_dict()`
    lists the shared `[vocab, hidden]` parameter under both `EMBEDDING` and `HEAD`, and the
    optimizer (`optimizer.sharded_state_dict`, keyed by the last structured name of each param)
    keeps its moments and master under `HEAD` only. The state moves to `EMBEDDING`; the head's
    copy of the weight goes (a model that ties its head reads the embedding). Tied is told by the
    files: the head has optimizer state and the embedding, of the same shape, has none (an untied
    embedding is trained and has its own)."""
    if EMBEDDING not in tensors or HEAD not in tensors:
        return
    states = [*slots.values(), master]
    if not any(HEAD in d and EMBEDDING not in d for d in states):
        return
    if tuple(tensors[HEAD].shape) != tuple(tensors[EMBEDDING].shape):
        raise FormatError(
            f"{HEAD!r} has shape {tuple(tensors[HEAD].shape)} and state of its own while "
            f"{EMBEDDING!r} ({tuple(tensors[EMBEDDING].shape)}) has none: not a tied head"
        )
    for d in states:
        if HEAD in d:
            d[EMBEDDING] = d.pop(HEAD)
    del tensors[HEAD]
    notes.append(
        f"tied head: the optimizer state saved under {HEAD!r} is the embedding's; the head's copy "
        "of the weight dropped"
    )


def zero_state_for_frozen(
    tensors: dict[str, LazyTensor], slots: dict[str, dict[str, LazyTensor]], notes: list[str]
) -> None:
    """Model params no slot has state for (frozen in Paddle, `stop_gradient`: ERNIE 4.5's
    `moe_statics.e_score_correction_bias`, which only chooses experts; the Trainer's optimizer
    never holds them) get zero moments in every slot, in place: AdamW's state of a param it never
    stepped, in the slot's dtype (Paddle's moments are fp32 whatever the param's), a broadcast
    view (no memory beyond the boxes read: the shape is the file's word). A param some slots
    hold and others do not is left for the import to refuse."""
    if not slots:
        return
    held = set().union(*(set(d) for d in slots.values()))
    frozen = sorted(n for n in tensors if n not in held)
    for d in slots.values():
        dt = np.dtype(next(iter(d.values())).dtype) if d else None
        for n in frozen:
            t = tensors[n]
            zero = np.zeros((), dt or np.dtype(t.dtype))
            d[n] = lazy.ArrayTensor(np.broadcast_to(zero, tuple(t.shape)))
    if frozen:
        notes.append(
            f"{len(frozen)} params without optimizer state (frozen: stop_gradient), e.g. "
            f"{frozen[0]!r}, given zero moments"
        )


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """A FlexCheckpoint step folder (or one bare FlexCheckpoint folder, or an output folder's
    latest `checkpoint-N/`) as lazy global tensors."""
    found = steps(os.path.abspath(path))
    if found is not None:
        src = _open_step(found.folder(found.default), config)
        return replace(src, notes=(f"output folder: {found.note(found.default)}", *src.notes))
    return _open_step(path, config)


def _open_step(path: str, config) -> SourceCheckpoint:
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        raise FormatError(f"{path}: a FlexCheckpoint is a folder")
    notes: list[str] = []
    bare = not os.path.isdir(os.path.join(folder, MODEL))
    parts = (
        {MODEL: folder}
        if bare
        else {
            p: os.path.join(folder, p)
            for p in (MODEL, OPTIMIZER, MASTER)
            if os.path.isdir(os.path.join(folder, p))
        }
    )
    opened = {}
    for part, sub in parts.items():
        names = os.listdir(sub)
        if part != MODEL and not any(DISTCP_RE.match(n) or METADATA_RE.match(n) for n in names):
            notes.append(f"{part}/ is empty (nothing was saved there); skipped")
            continue
        md = read_metadata(sub)
        opened[part] = (md, open_tensors(md))
    md_model, tensors = opened[MODEL]
    tensors = dict(tensors)
    folders = [folder, os.path.dirname(folder)]
    cfg = config_beside(*folders, config=config)
    slots: dict = {}
    master: dict[str, LazyTensor] = {}
    step = None
    hyper: dict = {}
    if OPTIMIZER in opened:
        md, opt_tensors = opened[OPTIMIZER]
        slots, pows = _split_optimizer(opt_tensors, md.path, notes)
        if any(pows.values()):
            step, b = adam_step(folder, pows, notes)
            hyper = {"betas": b} if b else {}
    if MASTER in opened:
        md, mw = opened[MASTER]
        for key, t in mw.items():
            if not key.endswith(".w_0"):
                raise FormatError(f"{md.path}: {key!r} is not a master weight (<name>.w_0)")
            master[key[: -len(".w_0")]] = t
    retie(tensors, slots, master, notes)
    zero_state_for_frozen(tensors, slots, notes)
    missing = sorted(set(master) - set(tensors))
    if missing:
        dt = _config_dtype(folders) or _model_dtype(cfg, tensors)
        if dt is None:
            dt = np.dtype(np.float32)
            notes.append(
                "model dtype unknown; params missing from model_state keep the fp32 masters"
            )
        for n in missing:
            tensors[n] = lazy.cast(master[n], dt)
        notes.append(
            f"{len(missing)} params rebuilt from fp32 master weights cast to {dt} (model_state holds "
            f"none of them)"
        )
    if not tensors:
        raise FormatError(f"{md_model.path}: no model tensors")
    for kind, named in (*slots.items(), ("master", master)):
        orphans = sorted(set(named) - set(tensors))
        if orphans:
            raise FormatError(
                f"{folder}: {kind} state for {orphans[:5]}, which model_state does not hold"
            )
    optimizer = OptimizerState(slots, step, master, hyper) if slots or master else None
    trainer = {} if bare else trainer_state(folder, notes)
    if hyper.get("betas"):  # kept by an import: an export to Paddle's layouts writes their pows
        trainer["adam_betas"] = [float(b) for b in hyper["betas"]]
    global_step = trainer.get("global_step")
    writers = {
        DISTCP_RE.match(os.path.basename(f)).group("rank")
        for md, _ in opened.values()
        for f in md.files
    }
    if global_step is None:
        global_step = CHECKPOINT_DIRS.number(os.path.basename(folder))
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=hf_rules(cfg, notes),
        config=cfg,
        step=global_step if isinstance(global_step, int) else step,
        topology={"writers": len(writers)},
        trainer=json.loads(json.dumps(trainer, default=repr)),
        notes=tuple(notes),
    )
