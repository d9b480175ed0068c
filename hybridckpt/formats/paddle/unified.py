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
rules file, `rules.FAMILIES`). PaddleFormers: HF names and no rules, moments and masters
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

import builtins
import json
import os
from collections.abc import Mapping

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import ConfigError, FormatError, MappingError
from hybridckpt.formats import hf
from hybridckpt.formats.paddle import paddleformers
from hybridckpt.formats.paddle.files import BF16, as_model_dtype
from hybridckpt.formats.paddle.optimizer import (
    BETA_POWS,
    DEFAULT_BETAS,
    SLOT_OF_ACCUMULATOR,
    adam_step,
    beta_pow,
    scalar,
)
from hybridckpt.formats.paddle.rules import family, hf_rule_vars, hf_rules, load_config
from hybridckpt.formats.rules_files import rules_text
from hybridckpt.io import safetensors_file
from hybridckpt.lazy import LazyTensor
from hybridckpt.source import OptimizerState, SourceCheckpoint

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
                beta_pows[acc].append(scalar(t))
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
        rules, rule_vars = rules_text(family(cfg, path).hf_rules), hf_rule_vars(cfg, tensors)
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


# -- export ----------------------------------------------------------------------------------


def _storable(t: LazyTensor) -> LazyTensor:
    return lazy.Bitcast(t, np.dtype(np.uint16)) if np.dtype(t.dtype) == BF16 else t


def _write_group(
    out_dir: str,
    prefix: str,
    index_name: str,
    tensors: Mapping[str, LazyTensor],
    max_shard_bytes: int,
    extra: Mapping | None = None,
    file_format: str = "np",
) -> list[str]:
    shards = safetensors_file.plan_shards(
        ((k, tensors[k].nbytes) for k in tensors), max_shard_bytes
    )
    weight_map, files = {}, []
    for i, names in enumerate(shards, 1):
        fname = f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors_file.write(
            os.path.join(out_dir, fname), {k: tensors[k] for k in names}, {"format": file_format}
        )
        files.append(fname)
        weight_map.update({k: fname for k in names})
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    index.update(extra or {})
    with builtins.open(os.path.join(out_dir, index_name), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return files + [index_name]


def write_unified(
    out_dir: str,
    hf_tensors: Mapping[str, LazyTensor],
    *,
    config,
    slots: Mapping[str, Mapping[str, LazyTensor]] | None = None,
    master: Mapping[str, LazyTensor] | None = None,
    step: int | None = None,
    betas: tuple[float, float] = DEFAULT_BETAS,
    dtype=None,
    fuse_attention_qkv: bool = False,
    fuse_attention_ffn: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    flavour: str = paddleformers.PADDLENLP,
) -> list[str]:
    """Write a unified checkpoint of an HF-named model into `out_dir`: PaddleNLP's (`flavour`
    "paddlenlp", the default; its family must have an entry in `rules.FAMILIES`) or
    PaddleFormers' ("paddleformers"; any family, HF names).

    hf_tensors: HF names -> tensors (`[out, in]`; LazyTensors or arrays), in the dtype to save
    (`dtype` casts them; bf16 is written as U16 like PaddleNLP). slots: optimizer slot name
    (torch's: "exp_avg", "exp_avg_sq", "momentum_buffer") -> HF name -> fp32 tensor (HF layout),
    each written as the Paddle accumulator of `optimizer.SLOT_OF_ACCUMULATOR`; master: fp32, HF
    names (optional: Paddle keeps them for 16-bit params); `step`: optimizer steps taken (the
    beta pows that go with Adam's moments = beta ** (step + 1), `optimizer.beta_pow`); needed
    with Adam moments. `fuse_attention_qkv` / `fuse_attention_ffn` write PaddleNLP's fused qkv /
    gate_up layers. Returns the file names written. PaddleNLP's names come from
    `RuleSet.invert()` of rules/paddle_decoder.rules (the mapping is written once, for import);
    PaddleFormers' optimizer state of Linear weights is transposed to `[in, out]`
    (`paddleformers.state_to_paddle`).
    """
    if flavour not in paddleformers.FLAVOURS:
        raise ConfigError(
            f"write_unified: flavour {flavour!r}; expected one of {paddleformers.FLAVOURS}"
        )

    def lazies(d):
        return {k: lazy.as_lazy(v) for k, v in d.items()}

    hf_params = lazies(hf_tensors)
    if flavour == paddleformers.PADDLENLP:
        inverse = hf_rules(
            config, fuse_qkv=fuse_attention_qkv, fuse_ffn=fuse_attention_ffn
        ).invert()
        params = inverse.apply(hf_params).tensors

        def stored(state, what):
            got = inverse.apply(lazies(state), strict=False).tensors
            missing = sorted(set(params) - set(got))
            if missing:
                raise MappingError(f"write_unified: no {what} for {missing[:10]}")
            return got

    else:
        params = hf_params

        def stored(state, what):
            return paddleformers.state_to_paddle(hf_params, lazies(state), what)

    if dtype is not None:
        params = {k: lazy.cast(t, dtype) for k, t in params.items()}
    os.makedirs(out_dir, exist_ok=True)
    state_key = {k: k for k in params}  # the name each param's optimizer state is saved under
    if flavour == paddleformers.PADDLENLP:
        model_files = {k: _storable(t) for k, t in params.items()}
        file_format = "np"
    else:  # as PaddleFormers' prepare_safe_save_state_dict: bf16 as BF16, {"format": "pt"}
        model_files = dict(params)
        file_format = "pt"
        if getattr(config, "tie_word_embeddings", False) and TIED_EMBEDDING in params:
            # the model's state dict lists the shared param under the head's name too, and the
            # optimizer keys take the last structured name of each param
            model_files.setdefault(TIED_HEAD, params[TIED_EMBEDDING])
            state_key[TIED_EMBEDDING] = TIED_HEAD
    written = _write_group(
        out_dir, "model", MODEL_INDEX, model_files, max_shard_bytes, file_format=file_format
    )
    if slots:
        accumulator = {slot: acc for acc, slot in SLOT_OF_ACCUMULATOR.items()}
        unknown = sorted(set(slots) - set(accumulator))
        if unknown:
            raise MappingError(
                f"write_unified: Paddle has no accumulator for slots {unknown}; known: "
                f"{sorted(accumulator)}"
            )
        pows = {acc: beta for acc, (slot, beta) in BETA_POWS.items() if slot in slots}
        if pows and step is None:
            raise ConfigError(
                f"write_unified: the optimizer step is needed to write {', '.join(sorted(pows))}"
            )
        pow_values = {acc: beta_pow(betas[beta], step) for acc, beta in pows.items()}
        opt: dict[str, LazyTensor] = {}
        per_slot = {slot: stored(tensors, slot) for slot, tensors in slots.items()}
        for k in params:
            for slot, tensors in per_slot.items():
                opt[f"{state_key[k]}/{accumulator[slot]}{ACCUMULATOR_SUFFIX}"] = lazy.cast(
                    tensors[k], np.float32
                )
            for acc, value in pow_values.items():
                opt[f"{state_key[k]}/{acc}{ACCUMULATOR_SUFFIX}"] = lazy.ArrayTensor(value)
        written += _write_group(
            out_dir,
            "optimizer",
            OPT_INDEX,
            opt,
            max_shard_bytes,
            {"master_weights": master is not None},
        )
    if master is not None:
        mw = stored(master, "master weights")
        written += _write_group(
            out_dir,
            "master_weights",
            MASTER_INDEX,
            {state_key[k]: lazy.cast(mw[k], np.float32) for k in params},
            max_shard_bytes,
        )
    from models import config_to_hf

    model_dtype = {
        np.dtype(np.float32): "float32",
        np.dtype(np.float16): "float16",
        BF16: "bfloat16",
    }
    cfg_json = dict(config_to_hf(config))
    first = next(iter(params.values()))
    cfg_json["dtype"] = model_dtype.get(np.dtype(first.dtype), str(first.dtype))
    if flavour == paddleformers.PADDLENLP:
        cfg_json["fuse_attention_qkv"] = fuse_attention_qkv
        cfg_json["fuse_attention_ffn"] = fuse_attention_ffn
    with builtins.open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg_json, f, indent=2)
    return written + ["config.json"]
