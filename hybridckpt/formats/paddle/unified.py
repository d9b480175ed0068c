"""Unified checkpoints of PaddleNLP and of PaddleFormers 1.x (`paddleformers.py`): import and export.

Format (PaddlePaddle/PaddleNLP: paddlenlp/trainer/unified_checkpoint/*, llm/docs/
unified_checkpoint.md; `load_save_single_card.py` is the single-card writer):
- `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json` (`{"metadata":
  {"total_size": bytes}, "weight_map": {name: file}}`): the whole model (TP merged, sharding
  gathered) under Paddle structured names (`llama.layers.0.self_attn.q_proj.weight`, Linear
  weights `[in, out]`), written by `safetensors.numpy.save_file` with metadata
  `{"format": "np"}`: bfloat16 is stored as `U16` bits.
- `optimizer-*.safetensors` + `optimizer.safetensors.index.json` (which also says
  `"master_weights": true|false`): `<name>/moment1_0`, `<name>/moment2_0`, `<name>/beta1_pow_acc_0`,
  `<name>/beta2_pow_acc_0` (fp32; beta pows `[1]` = beta ** (step + 1)); the accumulators are
  read as the slots torch names them (`optimizer.SLOT_OF_ACCUMULATOR`: moment1 -> exp_avg, ...).
- `master_weights-*.safetensors` + `master_weights.safetensors.index.json`: fp32 `<name>`.
- `config.json` (HF-style keys plus `"dtype"`).

PaddleFormers writes the same files under HF names with Linear weights `[out, in]` while its
moments and master weights stay `[in, out]` (`paddleformers.py`); `open` tells the flavours
apart (`paddleformers.flavour`). PaddleNLP: it returns Paddle names and `hf_rules` (the family's
paddlenlp dialect, `rules.family`). PaddleFormers: HF names and no rules, moments and masters
transposed to the weights' layout, so any family (Gemma 2/3 included) and any architecture
(model-agnostic) reads. Either way the step is the one the per-parameter beta pows agree on.
`write_unified` writes either flavour from HF-named tensors (`flavour=`): PaddleNLP's names come
from `RuleSet.invert()` of the family's rules (fused qkv / gate_up written unfused unless asked,
as PaddleNLP's default model); PaddleFormers' are the HF names, with the optimizer state
transposed back to `[in, out]`, model files as PaddleFormers 1.2 writes them (bf16 as `BF16`,
metadata `{"format": "pt"}`; a tied model's files list the shared weight under `lm_head.weight`
too, and its optimizer state and master are under `lm_head.weight`: checked against the
Trainer's own files, tests/real/cases/paddleformers_*).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hybridckpt import models
from hybridckpt.errors import FormatError
from hybridckpt.formats import hf
from hybridckpt.formats.paddle import paddleformers
from hybridckpt.formats.paddle.files import as_model_dtype
from hybridckpt.formats.paddle.optimizer import (
    BETA_POWS,
    SLOT_OF_ACCUMULATOR,
    adam_step,
    scalar,
)
from hybridckpt.formats.paddle.rules import families, family, hf_rule_vars, load_config
from hybridckpt.lazy import LazyTensor
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "paddle-unified"
MODEL_INDEX = "model.safetensors.index.json"
OPT_INDEX = "optimizer.safetensors.index.json"
MASTER_INDEX = "master_weights.safetensors.index.json"
ACCUMULATOR_SUFFIX = "_0"  # `<name>/<accumulator>_0`
TIED_EMBEDDING, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"
MAX_SHARD_BYTES = 2 * 1024**3


def _index(folder: str, name: str) -> dict[str, str] | None:
    return hf.read_index(os.path.join(folder, name))


def detect(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    has = {i: os.path.isfile(os.path.join(path, i)) for i in (MODEL_INDEX, OPT_INDEX, MASTER_INDEX)}
    if not (has[MODEL_INDEX] or (has[OPT_INDEX] and has[MASTER_INDEX])):
        return False  # a save without model files ("skip_save_model_weight") keeps the masters
    try:
        model = _index(path, MODEL_INDEX) or {}
        opt = _index(path, OPT_INDEX) or {}
    except FormatError:
        return False
    # PaddleNLP's prefixed names, or (either flavour, HF names too) Paddle's accumulator keys
    return paddleformers.has_paddlenlp_names(model) or any("/moment1_0" in k for k in opt)


read_indexed = hf.read_indexed  # lazy tensors of every file an index names


def adam_betas(optimizer: OptimizerState | None) -> dict:
    """`{"adam_betas": [b1, b2]}` for the trainer state (kept by an import, so that an export
    to Paddle's layouts writes the beta pows of the run's betas), or {}."""
    betas = optimizer.hyper.get("betas") if optimizer is not None else None
    return {"adam_betas": [float(b) for b in betas]} if betas else {}


def _whole_tensors(where: str, weights: Mapping[str, LazyTensor], state: Mapping[str, LazyTensor]) -> None:
    """Refuse 1-D optimizer state (or masters) of a param with more axes: what PaddleFormers
    writes under sharding stage1 v2 (`split_param`) when `unified_checkpoint_config` lacks
    "gather_split_param": each rank's `optimizer.state_dict()`, padded 1-D slices of the sharding
    buffers under the param names, a param split over two ranks in two files of which the index
    names one (checked on PaddleFormers 1.2's own save, tests/real/cases/
    paddleformers_untied_bf16_sharding2/ckpt/unified_split). The pieces' offsets are not in the
    files, so they cannot be put back together."""
    for name, t in state.items():
        w = weights.get(name)
        if w is not None and len(t.shape) == 1 and len(w.shape) > 1:
            raise FormatError(
                f"{where}: {name!r} is a 1-D piece of {t.shape[0]} elements for a param of shape "
                f"{tuple(w.shape)}: sharding stage1 v2 (split_param) state saved without "
                f"unified_checkpoint_config 'gather_split_param' (each rank's padded slice, not whole "
                f"tensors); save again with 'gather_split_param'"
            )


def refuse_own_names(cfg, path: str, tensors: Mapping[str, LazyTensor]) -> None:
    """A FormatError for a PaddleFormers unified checkpoint of a family PaddleNLP never had
    (no paddlenlp dialect: ERNIE 4.5), whose Linear weights look PaddleNLP's `[in, out]`: PaddleFormers
    saved the model's own module names (ERNIE's fused `qkv_proj` / `up_gate_proj`, left `[in,
    out]` while its other Linears are transposed to HF's), which only its FlexCheckpoint is read
    under (models/<family>/dialects/flex_checkpoint.rules)."""
    if cfg is None or getattr(cfg, "family", None) in families():
        return
    fam = models.family_of(cfg)
    fused = sorted(n for n in tensors if n.endswith((".qkv_proj.weight", ".up_gate_proj.weight")))
    flex = fam is not None and fam.dialect("flex_checkpoint") is not None
    raise FormatError(
        f"{path}: a PaddleFormers unified checkpoint of {getattr(cfg, 'family', '?')} under the model's "
        f"own names and layouts ({(fused or sorted(tensors))[0]!r}, stored [in, out]) is not read"
        + ("; its FlexCheckpoint is (save_checkpoint_format='flex_checkpoint', the Trainer's default)"
           if flex else "")
    )


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """A unified checkpoint folder as lazy tensors (bf16 restored from U16): PaddleNLP's under
    Paddle names with the family's rules, PaddleFormers' under HF names in HF layouts."""
    model = read_indexed(path, MODEL_INDEX)
    master = read_indexed(path, MASTER_INDEX)
    opt = read_indexed(path, OPT_INDEX)
    cfg = load_config(path, config)
    notes: list[str] = []
    paddlenlp_names = paddleformers.has_paddlenlp_names([*model, *master])
    if getattr(cfg, "tie_word_embeddings", False):  # state saved under the head's name
        prefix = family(cfg, path).prefix if paddlenlp_names else "model"
        opt, master = paddleformers.retied(opt, master, f"{prefix}.embed_tokens.weight")
    from_masters = not os.path.isfile(os.path.join(path, MODEL_INDEX)) and bool(master)
    if from_masters:  # "skip_save_model_weight": the masters are loaded as the model weights
        model = dict(master) if paddlenlp_names else paddleformers.weights_from_masters(master)
        notes.append(f"no {MODEL_INDEX}: the params are the fp32 master weights")
    if not model:
        raise FormatError(f"{path}: {MODEL_INDEX} names no tensors")
    tensors = {k: as_model_dtype(t) for k, t in model.items()}
    optimizer = None
    if opt or master:
        kinds = [*SLOT_OF_ACCUMULATOR, *BETA_POWS]
        slots: dict[str, dict[str, LazyTensor]] = {}
        beta_pows: dict[str, list[float]] = {k: [] for k in BETA_POWS}
        for key, t in opt.items():
            name, sep, kind = key.rpartition("/")
            acc = kind.removesuffix(ACCUMULATOR_SUFFIX)
            if not sep or acc == kind or acc not in kinds:
                raise FormatError(
                    f"{os.path.join(path, OPT_INDEX)}: key {key!r} is not <name>/<kind> with kind in "
                    f"{sorted(k + ACCUMULATOR_SUFFIX for k in kinds)}"
                )
            if name not in tensors:
                raise FormatError(
                    f"{os.path.join(path, OPT_INDEX)}: {key!r} is for {name!r}, which the model lacks"
                )
            if acc in beta_pows:
                beta_pows[acc].append(scalar(t, f"{os.path.join(path, OPT_INDEX)}: {key!r}"))
            else:
                slots.setdefault(SLOT_OF_ACCUMULATOR[acc], {})[name] = t
        unknown = sorted(set(master) - set(tensors))
        if unknown:
            raise FormatError(
                f"{os.path.join(path, MASTER_INDEX)}: master weights for unknown params {unknown[:10]}"
            )
        for where, named in ((OPT_INDEX, t) for t in slots.values()):
            _whole_tensors(os.path.join(path, where), tensors, named)
        _whole_tensors(os.path.join(path, MASTER_INDEX), tensors, master)
        step, hyper = adam_step(path, beta_pows, notes)
        optimizer = OptimizerState(slots, step, master, hyper)
    kind = paddleformers.flavour(
        tensors, (optimizer.slots if optimizer else {}).get("exp_avg", {}), cfg
    )
    if from_masters and not paddlenlp_names:
        kind = paddleformers.PADDLEFORMERS  # HF names: the masters were put in HF layout above
    if kind == paddleformers.PADDLENLP and not paddlenlp_names:
        refuse_own_names(cfg, path, tensors)
    if kind == paddleformers.PADDLEFORMERS:
        if optimizer is not None:  # moments and masters of Linear weights are [in, out]
            where = os.path.join(path, OPT_INDEX)
            slots = {
                s: paddleformers.state_to_hf(tensors, d, where) for s, d in optimizer.slots.items()
            }
            master = paddleformers.state_to_hf(
                tensors, optimizer.master, os.path.join(path, MASTER_INDEX)
            )
            optimizer = OptimizerState(slots, optimizer.step, master, optimizer.hyper)
        rules, rule_vars = "", {}
    else:
        rules, rule_vars = family(cfg, path).hf_rules, hf_rule_vars(cfg, tensors)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=rules,
        rule_vars=rule_vars,
        config=cfg,
        step=optimizer.step if optimizer else None,
        trainer={"flavour": kind, **adam_betas(optimizer)},
        notes=tuple(notes),
    )
