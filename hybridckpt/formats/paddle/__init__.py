"""PaddleNLP hybrid-parallel checkpoints (Trainer `checkpoint-<step>/`), and single `.pdparams`.

Format (PaddlePaddle/PaddleNLP: paddlenlp/trainer/trainer.py, trainer/utils/sharding_io.py,
trainer/utils/ckpt_converter.py; details and checks in /work/shared/formats/paddle.md):
- `model_state[.SFX].pdparams`: paddle.save state dict `{structured name: array,
  "StructuredToParameterName@@": {structured name: param.name}}` per (tp, pp), or per
  (tp, pp, shard) with `save_sharded_model`. bf16 + sharded save drops the params that have
  master weights (ckpt_converter.py treats files of at most 512 bytes as "not stored"; here the
  contents decide): missing params are rebuilt from the fp32 master weights cast to the model
  dtype (param_meta, else config.json `dtype`).
- `optimizer[.SFX].pdopt`: accumulators `<param.name>[_fp32_master_0]_<acc>_0` (acc: moment1,
  moment2, beta1_pow_acc, beta2_pow_acc for AdamW; velocity for Momentum), returned as the
  slots torch names them (`SLOT_OF_ACCUMULATOR`), `master_weights: {param.name: fp32}` (stage 3:
  `slice@<param.name>`), `LR_Scheduler`. `param.name`s restart on every rank: an accumulator is
  matched to its structured name only through the name table of its own (tp, pp) (the
  model_state files or `model_meta.json` `sharding_metas.tpXX_ppYY.structure_name_mapping`).
- SFX is `tpNN` (tp > 1), `ppNN` (pp > 1), `shardNN` (sharding > 1) joined by `_`; degrees are
  max rank + 1 (or `model_meta.json` `parallel_config`), and every file of the grid must exist.
- Sharding: stage1 v1 / stage2 give whole params to one rank (merge = union); stage1 v2 packs
  params padded into flat buffers split evenly over ranks, each rank keeping a 1-D slice
  (padding included); stage3 slices large params evenly. Both flat layouts rebuild the same
  way: the 1-D pieces in sharding-rank order, concatenated, `[:numel]`, reshaped to the local
  shape (from model_state or `param_meta`). A checkpoint mixing whole and flat layouts, or
  `model_meta.json` strategies, is refused.
- TP: shards of one structured name merge by the `tp` statements of
  `rules/paddle_llama_tp.rules` (never guessed from shapes). PP: files hold global single-card
  names (merge = union); raw PipelineLayer keys (`[_layers.]N.rest`, `shared_layers.<name>.*`)
  are first renamed by the sequential prefixes of PaddleNLP's LlamaForCausalLMPipe.
- bf16 is stored as uint16 bits: model params of dtype uint16 are viewed as bfloat16; moments
  and master weights are fp32.

Returned names are Paddle structured names (`llama.layers.0.self_attn.q_proj.weight`, weights
`[in, out]`); `hf_rules` (rules/paddle_llama.rules) maps them to HF names. The optimizer step
comes from `beta1_pow_acc = beta1 ** (step + 1)` (betas from `training_args.bin` when readable,
else Paddle's defaults 0.9 / 0.999); the training step from `trainer_state.json`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import ConfigError, FormatError, HybridCkptError, MappingError
from hybridckpt.formats.config_file import config_beside, read_json
from hybridckpt.formats.rules_files import load_rules, rules_text
from hybridckpt.io.pickle import paddle_save
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import RuleSet
from hybridckpt.source import OptimizerState, SourceCheckpoint

NAME = "paddle"

MODEL_META = "model_meta.json"
DEFAULT_BETAS = (0.9, 0.999)  # paddle.optimizer.AdamW / PaddleNLP TrainingArguments defaults
BF16 = np.dtype(ml_dtypes.bfloat16)

_MODEL_RE = re.compile(r"^model_state(?:\.(?P<sfx>[A-Za-z0-9_]+))?\.pdparams$")
_OPT_RE = re.compile(r"^optimizer(?:\.(?P<sfx>[A-Za-z0-9_]+))?\.pdopt$")
_SFX_RE = re.compile(r"^(tp|pp|shard)(\d+)$")
# Paddle's per-parameter optimizer accumulators (paddle/optimizer/adamw.py `_moment1_acc_str`,
# `_moment2_acc_str`; momentum.py `_velocity_acc_str`) -> the slot torch gives the same state
SLOT_OF_ACCUMULATOR = {
    "moment1": "exp_avg",
    "moment2": "exp_avg_sq",
    "velocity": "momentum_buffer",
}
# the Adam moment each `[1]` beta pow accumulator goes with, and which beta it powers (0 or 1)
BETA_POWS = {"beta1_pow_acc": ("exp_avg", 0), "beta2_pow_acc": ("exp_avg_sq", 1)}
ACCUMULATOR_RE = re.compile(
    r"^(?:slice@)?(?P<p>.+?)(?:_fp32_master_\d+)?_(?P<acc>"
    + "|".join([*SLOT_OF_ACCUMULATOR, *BETA_POWS])
    + r")_\d+$"
)
# model_meta.json param_meta dtype ids: Paddle 2.x (FP16=4, FP32=5, BF16=22) and Paddle 3.x
# (FLOAT32=10, FLOAT16=15, BFLOAT16=16); the two sets do not overlap for float types.
META_DTYPES = {
    4: np.dtype(np.float16),
    5: np.dtype(np.float32),
    22: BF16,
    10: np.dtype(np.float32),
    15: np.dtype(np.float16),
    16: BF16,
}
_STR_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


# -- rules ------------------------------------------------------------------------------------


def llama_variables(cfg, tp: int = 1, *, fuse_qkv: bool = False, fuse_ffn: bool = False) -> dict:
    """Variables of the Paddle Llama rules: heads, tying, fused layers, what TP `tp` splits."""
    if getattr(cfg, "family", None) != "llama":
        raise ConfigError(
            f"PaddleNLP checkpoints are read for Llama models; the config is "
            f"{type(cfg).__name__} ({getattr(cfg, 'family', '?')})"
        )
    return {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "tied": bool(cfg.tie_word_embeddings),
        "vocab_split": cfg.vocab_size % tp == 0,
        "kv_split": cfg.num_kv_heads % tp == 0,
        "fuse_attention_qkv": bool(fuse_qkv),
        "fuse_attention_ffn": bool(fuse_ffn),
    }


def fused_flags(names) -> dict:
    """PaddleNLP's `fuse_attention_qkv` / `fuse_attention_ffn`, read off the tensor names."""
    names = list(names)
    return {
        "fuse_qkv": any(n.endswith(".self_attn.qkv_proj.weight") for n in names),
        "fuse_ffn": any(n.endswith(".mlp.gate_up_fused_proj.weight") for n in names),
    }


HF_RULE_VARS = ("num_heads", "num_kv_heads", "tied", "fuse_attention_qkv", "fuse_attention_ffn")


def hf_rules(cfg, *, fuse_qkv: bool = False, fuse_ffn: bool = False) -> RuleSet:
    """PaddleNLP Llama structured names -> HF names (`rules/paddle_llama.rules`)."""
    variables = llama_variables(cfg, fuse_qkv=fuse_qkv, fuse_ffn=fuse_ffn)
    return load_rules("paddle_llama.rules", variables)


def tp_rules(cfg, tp: int) -> RuleSet:
    return load_rules("paddle_llama_tp.rules", llama_variables(cfg, tp))


# -- small helpers -------------------------------------------------------------------------------


def load_config(folder: str, config=None):
    """`config`, or the model config from `folder/config.json` (PaddleNLP writes HF-style keys)."""
    return config_beside(folder, config=config, required_for="a PaddleNLP checkpoint")


def config_dtype(folder: str) -> np.dtype | None:
    """The model dtype PaddleNLP records in config.json (`"dtype": "bfloat16"`), if any."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    return _STR_DTYPES.get(str(read_json(path).get("dtype", "")))


def as_model_dtype(t: LazyTensor) -> LazyTensor:
    """A model param as paddle.save stored it: uint16 holds bfloat16 bits (np.array of a bf16
    paddle Tensor is uint16), so view it as bfloat16."""
    return paddle_save.reinterpret(t, BF16) if np.dtype(t.dtype) == np.uint16 else t


def step_from_beta_pow(value: float, beta: float) -> int | None:
    """Optimizer steps taken from a Paddle `beta_pow_acc`.

    Paddle's AdamW starts the accumulator at beta and multiplies it by fp32(beta) after each
    step (phi adamw kernel: `beta1_pow_out = beta1_pow * beta1` in fp32), so after `step` steps
    it holds beta ** (step + 1); the log in base fp32(beta) recovers the exponent to within
    0.01 while the value is a normal fp32 (0.9: ~830 steps, 0.999: ~87000). None when it has
    underflowed or is not a power of `beta`."""
    if not (np.finfo(np.float32).tiny <= value <= 1.0) or not (0.0 < beta < 1.0):
        return None
    k = math.log(value) / math.log(float(np.float32(beta)))
    n = round(k)
    if abs(k - n) > 0.1:
        return None
    return max(n - 1, 0)


def beta_pow(beta: float, step: int) -> np.ndarray:
    """The `[1]` fp32 accumulator Paddle holds after `step` steps: fp32(beta) multiplied in
    fp32 `step + 1` times (sequential cumprod reproduces the kernel's rounding)."""
    return np.cumprod(np.full(step + 1, beta, dtype=np.float32), dtype=np.float32)[-1:].copy()


def adam_step(folder: str, beta_pows: Mapping[str, Sequence[float]], notes: list[str]):
    """(optimizer step, hyper) from the beta pow accumulators found (`BETA_POWS` name -> values)
    and the betas of `folder` (a note in `notes` when Paddle's defaults were assumed); (None, {})
    when there are none (an optimizer without them)."""
    if not any(beta_pows.values()):
        return None, {}
    betas, note = _betas(folder)
    step = optimizer_step(beta_pows["beta1_pow_acc"], beta_pows["beta2_pow_acc"], betas)
    if step is not None and note:
        notes.append(note)
    return step, {"betas": list(betas)}


def optimizer_step(beta1_pows: Sequence[float], beta2_pows: Sequence[float], betas) -> int | None:
    """The step all beta pow accumulators agree on (beta1 first: more precise), else None."""
    for values, beta in ((beta1_pows, betas[0]), (beta2_pows, betas[1])):
        steps = {step_from_beta_pow(float(v), beta) for v in values}
        steps.discard(None)
        if len(steps) == 1:
            return steps.pop()
    return None


def _scalar(t: LazyTensor) -> float:
    return float(np.asarray(t.materialize(), dtype=np.float64).reshape(-1)[0])


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return repr(x)


# -- pipeline descriptor names ------------------------------------------------------------------


def pp_prefixes(num_layers: int) -> dict[int, str]:
    """LlamaForCausalLMPipe's sequential layers (paddlenlp/transformers/llama/modeling_pp.py):
    desc 0 embedding ("llama"), 1..L decoder layers ("llama.layers.i"), L+1 norm ("llama"),
    L+2 lm head ("lm_head")."""
    out = {0: "llama", num_layers + 1: "llama", num_layers + 2: "lm_head"}
    out.update({i + 1: f"llama.layers.{i}" for i in range(num_layers)})
    return out


def single_card_name(key: str, num_layers: int, pp_rank: int) -> str:
    """A PipelineLayer key (`[_layers.]N.rest`, `[_layers.]C.N.rest` with virtual stages,
    `[_layers.]shared_layers.<name>.rest`) as PaddleNLP's `_set_pipeline_name_mapping` renames it;
    other keys unchanged. The shared (tied) layer is the embedding on pp stage 0 and the LM head
    on later stages."""
    parts = key.split(".")
    if parts[0] == "_layers":
        parts = parts[1:]
    if not parts or not (parts[0].isdigit() or parts[0] == "shared_layers"):
        return key
    prefixes = pp_prefixes(num_layers)
    if parts[0] == "shared_layers":
        if len(parts) < 3:
            return key
        prefix, rest = ("llama" if pp_rank == 0 else "lm_head"), parts[2:]
    elif len(parts) > 2 and parts[1].isdigit():
        prefix, rest = prefixes.get(int(parts[0]) + int(parts[1])), parts[2:]
    else:
        prefix, rest = prefixes.get(int(parts[0])), parts[1:]
    if prefix is None:
        raise FormatError(f"pipeline key {key!r}: descriptor index outside 0..{num_layers + 2}")
    return ".".join([prefix, *rest])


# -- file grid ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """The files of a hybrid-parallel folder by (tp, pp[, shard]) rank."""

    folder: str
    tp: int
    pp: int
    sharding: int
    model: Mapping[tuple[int, int], Mapping[int | None, str]]
    optimizer: Mapping[tuple[int, int], Mapping[int, str]]
    meta: Mapping | None = None
    ignored: tuple[str, ...] = ()


def _ranks(sfx: str | None, fname: str) -> tuple[int, int, int | None]:
    tp, pp, shard = 0, 0, None
    for tok in (sfx or "").split("_") if sfx else ():
        m = _SFX_RE.match(tok)
        if not m:
            raise FormatError(
                f"{fname}: unsupported file suffix part {tok!r} (expected tpNN, ppNN, shardNN)"
            )
        kind, n = m.group(1), int(m.group(2))
        if kind == "tp":
            tp = n
        elif kind == "pp":
            pp = n
        else:
            shard = n
    return tp, pp, shard


def _sfx(g: Grid, tp: int, pp: int, shard: int | None) -> str:
    parts = []
    if g.tp > 1:
        parts.append(f"tp{tp:02d}")
    if g.pp > 1:
        parts.append(f"pp{pp:02d}")
    if shard is not None and g.sharding > 1:
        parts.append(f"shard{shard:02d}")
    return ("." + "_".join(parts)) if parts else ""


def scan(folder: str) -> Grid:
    """Find the model/optimizer files of `folder`, their degrees, and check the grid is complete."""
    model: dict = {}
    optimizer: dict = {}
    ignored = []
    for fname in sorted(os.listdir(folder)):
        m, o = _MODEL_RE.match(fname), _OPT_RE.match(fname)
        if m:
            tp, pp, shard = _ranks(m.group("sfx"), fname)
            model.setdefault((tp, pp), {})[shard] = os.path.join(folder, fname)
        elif o:
            tp, pp, shard = _ranks(o.group("sfx"), fname)
            optimizer.setdefault((tp, pp), {})[shard or 0] = os.path.join(folder, fname)
        elif fname.endswith((".pdparams", ".pdopt", ".pth", ".bin")):
            ignored.append(fname)
    if not model and not optimizer:
        raise FormatError(f"{folder}: no model_state*.pdparams or optimizer*.pdopt files")
    meta = None
    if os.path.isfile(os.path.join(folder, MODEL_META)):
        meta = read_json(os.path.join(folder, MODEL_META))
        _check_meta(meta, os.path.join(folder, MODEL_META))
    keys = set(model) | set(optimizer)
    tp = max(k[0] for k in keys) + 1
    pp = max(k[1] for k in keys) + 1
    shards = [
        s for d in list(model.values()) + list(optimizer.values()) for s in d if s is not None
    ]
    sharding = max(shards) + 1 if shards else 1
    if meta is not None:
        pc = meta.get("parallel_config") or {}
        want = (
            pc.get("mp_degree", tp),
            pc.get("pp_degree", pp),
            pc.get("sharding_degree", sharding),
        )
        if not all(isinstance(w, int) and w >= 1 for w in want):
            raise FormatError(f"{os.path.join(folder, MODEL_META)}: bad parallel_config {pc!r}")
        if want[0] < tp or want[1] < pp or want[2] < sharding:
            raise FormatError(
                f"{os.path.join(folder, MODEL_META)}: parallel_config says tp {want[0]}, pp {want[1]}, "
                f"sharding {want[2]} but the files go up to tp {tp}, pp {pp}, sharding {sharding}"
            )
        tp, pp, sharding = want
    g = Grid(folder, tp, pp, sharding, model, optimizer, meta, tuple(ignored))
    # completeness: every (tp, pp) needs its model state (or master weights + meta), every
    # (tp, pp, shard) its optimizer file when the checkpoint has optimizer files at all
    for t in range(tp):
        for p in range(pp):
            if optimizer:
                for s in range(sharding):
                    if s not in optimizer.get((t, p), {}):
                        raise FormatError(
                            f"{folder}: missing optimizer{_sfx(g, t, p, s)}.pdopt "
                            f"(the checkpoint has tp {tp}, pp {pp}, sharding {sharding})"
                        )
            files = model.get((t, p), {})
            sharded = [s for s in files if s is not None]
            if sharded and len(sharded) < sharding:
                miss = min(set(range(sharding)) - set(sharded))
                raise FormatError(f"{folder}: missing model_state{_sfx(g, t, p, miss)}.pdparams")
            if not files and not optimizer:
                raise FormatError(f"{folder}: missing model_state{_sfx(g, t, p, None)}.pdparams")
            if not files and meta is None:
                raise FormatError(
                    f"{folder}: missing model_state{_sfx(g, t, p, None)}.pdparams, and there is no "
                    f"{MODEL_META} to name the optimizer's parameters"
                )
    return g


# -- one (tp, pp) group --------------------------------------------------------------------------


@dataclass
class _Piece:
    tensor: LazyTensor
    file: str
    key: str


@dataclass
class _Group:
    """Everything one (tp, pp) rank group saved, under structured names."""

    model: dict[str, _Piece] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    # name -> kind (an accumulator: moment1, ..., beta1_pow_acc, ...; or master) -> shard -> piece
    states: dict[str, dict[str, dict[int, _Piece]]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def _meta_for(g: Grid, tp: int, pp: int) -> Mapping | None:
    if g.meta is None:
        return None
    metas = g.meta.get("sharding_metas") or {}
    return metas.get(f"tp{tp:02d}_pp{pp:02d}")


def _read_group(g: Grid, tp: int, pp: int, num_layers: int) -> _Group:
    grp = _Group()
    meta = _meta_for(g, tp, pp)

    def rename(k: str) -> str:
        return single_card_name(k, num_layers, pp)

    table: dict[str, str] = {}  # structured -> param.name
    for _shard, path in sorted(
        g.model.get((tp, pp), {}).items(), key=lambda kv: -1 if kv[0] is None else kv[0]
    ):
        d = paddle_save.read(path)
        for k, name in d.names.items():
            table.setdefault(rename(k), name)
        for k, t in d.tensors.items():  # an "empty" model_state (<= 512 bytes) holds none
            n = rename(k)
            if n in grp.model:
                if grp.model[n].tensor.shape != t.shape:
                    raise FormatError(
                        f"{path}: {k!r} has shape {t.shape} but {grp.model[n].file} holds it with "
                        f"shape {grp.model[n].tensor.shape}"
                    )
                continue
            grp.model[n] = _Piece(as_model_dtype(t), path, k)
            grp.order.append(n)
    if meta is not None:
        for k, name in (meta.get("structure_name_mapping") or {}).items():
            table.setdefault(rename(k), name)
        for k, pm in (meta.get("param_meta") or {}).items():
            n = rename(k)
            try:
                if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in pm[0]):
                    raise ValueError("shape dims must be non-negative ints")
                grp.shapes.setdefault(n, tuple(pm[0]))
                if len(pm) > 1 and int(pm[1]) in META_DTYPES:
                    grp.dtypes.setdefault(n, META_DTYPES[int(pm[1])])
            except (TypeError, ValueError, IndexError):
                raise FormatError(
                    f"{os.path.join(g.folder, MODEL_META)}: bad param_meta for {k!r}: {pm!r}"
                ) from None
            if n not in grp.order:
                grp.order.append(n)
    for n in table:
        if n not in grp.order:
            grp.order.append(n)
    for n, p in grp.model.items():
        grp.shapes[n] = tuple(p.tensor.shape)
        grp.dtypes[n] = np.dtype(p.tensor.dtype)
    by_param: dict[str, str] = {}
    for n, pname in table.items():
        by_param.setdefault(pname, n)  # tied single card: the embedding is listed first
    for shard, path in sorted(g.optimizer.get((tp, pp), {}).items()):
        d = paddle_save.read(path)
        if not grp.extra and d.extra:
            grp.extra = dict(d.extra)
        for k, t in d.tensors.items():
            m = ACCUMULATOR_RE.match(k)
            if not m:
                raise FormatError(
                    f"{path}: optimizer key {k!r} is not <param>_<accumulator>_N "
                    f"({', '.join([*SLOT_OF_ACCUMULATOR, *BETA_POWS])})"
                )
            _add_state(grp, by_param, m.group("p"), m.group("acc"), shard, _Piece(t, path, k), path)
        master = d.children.get("master_weights")
        if master is not None:
            for k, t in master.tensors.items():
                pname = k[len("slice@") :] if k.startswith("slice@") else k
                _add_state(
                    grp,
                    by_param,
                    pname,
                    "master",
                    shard,
                    _Piece(t, path, f"master_weights/{k}"),
                    path,
                )
    return grp


def _source_files(grp: _Group, n: str, kind: str) -> list[str]:
    """The files one tp rank's tensor `n` of `kind` (model, an accumulator, master) came from."""
    if kind == "model":
        return [grp.model[n].file] if n in grp.model else []
    return sorted({p.file for p in grp.states.get(n, {}).get(kind, {}).values()})


def _check_meta(meta: dict, path: str) -> None:
    """The parts of model_meta.json read here have the types PaddleNLP writes."""
    pc = meta.get("parallel_config")
    if pc is not None and not isinstance(pc, dict):
        raise FormatError(f"{path}: parallel_config is {type(pc).__name__}, expected an object")
    metas = meta.get("sharding_metas")
    if metas is None:
        return
    if not isinstance(metas, dict):
        raise FormatError(f"{path}: sharding_metas is {type(metas).__name__}, expected an object")
    for key, m in metas.items():
        if not isinstance(m, dict):
            raise FormatError(f"{path}: sharding_metas[{key!r}] is {type(m).__name__}, expected an object")
        names = m.get("structure_name_mapping")
        if names is not None and not (
            isinstance(names, dict) and all(isinstance(v, str) for v in names.values())
        ):
            raise FormatError(f"{path}: sharding_metas[{key!r}].structure_name_mapping is not name -> name")
        strategy = m.get("sharding_strategy")
        if strategy is not None and not isinstance(strategy, str):
            raise FormatError(f"{path}: sharding_metas[{key!r}].sharding_strategy is not a string")
        pm = m.get("param_meta")
        if pm is not None and not (
            isinstance(pm, dict) and all(isinstance(v, (list, tuple)) for v in pm.values())
        ):
            raise FormatError(f"{path}: sharding_metas[{key!r}].param_meta is not name -> [shape, dtype]")


def _add_state(
    grp: _Group, by_param, pname: str, kind: str, shard: int, piece: _Piece, path: str
) -> None:
    n = by_param.get(pname)
    if n is None:
        raise FormatError(
            f"{path}: {piece.key!r} belongs to parameter {pname!r}, which no structured name maps to "
            f"in this (tp, pp)'s name table (model_state StructuredToParameterName@@ or "
            f"{MODEL_META} structure_name_mapping)"
        )
    slot = grp.states.setdefault(n, {}).setdefault(kind, {})
    if shard in slot:
        raise FormatError(f"{path}: {piece.key!r} appears twice for {n!r} ({slot[shard].key!r})")
    slot[shard] = piece


# -- stitching sharding pieces ---------------------------------------------------------------------


def _layout(piece: _Piece, shape: tuple[int, ...]) -> str:
    if tuple(piece.tensor.shape) == tuple(shape):
        return "whole"
    if piece.tensor.ndim == 1:
        return "flat"
    return "bad"


def stitch(
    name: str, kind: str, pieces: Mapping[int, _Piece], shape: tuple[int, ...] | None
) -> LazyTensor:
    """One local (per tp rank) tensor from its pieces on the sharding ranks.

    Whole pieces (stage1 v1 / stage2 / unsliced stage3): the piece (replicas must agree in
    shape). Flat 1-D pieces (stage1 v2 / stage3): concatenated in rank order, `[:numel]`,
    reshaped to `shape`.
    """
    ranks = sorted(pieces)
    first = pieces[ranks[0]]
    if shape is None:
        if len(ranks) == 1:
            return first.tensor
        raise FormatError(
            f"{first.file}: {first.key!r} ({name} {kind}) is split over sharding ranks {ranks} but "
            f"its shape is unknown: the model_state files do not hold it and there is no "
            f"{MODEL_META} param_meta"
        )
    layouts = {r: _layout(pieces[r], shape) for r in ranks}
    if all(v == "whole" for v in layouts.values()):
        return first.tensor
    if any(v != "flat" for v in layouts.values()) or math.prod(shape) == 0:
        desc = ", ".join(
            f"{pieces[r].file}:{pieces[r].key} {tuple(pieces[r].tensor.shape)}" for r in ranks
        )
        raise FormatError(f"{name} ({kind}): pieces do not fit the parameter shape {shape}: {desc}")
    if ranks != list(range(ranks[0], ranks[-1] + 1)):
        raise FormatError(
            f"{name} ({kind}): flat sharding slices on ranks {ranks} are not consecutive "
            f"(files {[pieces[r].file for r in ranks]})"
        )
    numel = math.prod(shape)
    flat = lazy.concat([pieces[r].tensor for r in ranks], 0)
    if flat.shape[0] < numel:
        raise FormatError(
            f"{name} ({kind}): sharding slices {[pieces[r].key for r in ranks]} in "
            f"{sorted({pieces[r].file for r in ranks})} hold {flat.shape[0]} elements but the "
            f"parameter {shape} has {numel}"
        )
    return lazy.reshape(lazy.slice_axis(flat, 0, 0, numel), shape)


def _check_strategies(g: Grid, groups: Mapping[tuple[int, int], _Group]) -> None:
    """Refuse checkpoints that mix whole (v1/stage2) and flat (v2/stage3) optimizer layouts."""
    if g.meta is not None:
        strategies = {
            k: m.get("sharding_strategy")
            for k, m in (g.meta.get("sharding_metas") or {}).items()
            if isinstance(m, Mapping) and m.get("sharding_strategy")
        }
        if len(set(strategies.values())) > 1:
            raise FormatError(
                f"{os.path.join(g.folder, MODEL_META)}: mixed sharding strategies {strategies}"
            )
    # whole params owned by one sharding rank (stage1 v1 / stage2) and flat slices (stage1 v2 /
    # stage3; stage3 also replicates small params whole on every rank) cannot come from one run
    seen: dict[str, tuple[str, str, tuple]] = {}
    for grp in groups.values():
        for n, kinds in grp.states.items():
            shape = grp.shapes.get(n)
            if shape is None or len(shape) < 2:
                continue  # 1-D params look the same whole and flat
            for kind, pieces in kinds.items():
                if kind in BETA_POWS:
                    continue
                lays = {_layout(p, shape) for p in pieces.values()}
                p = pieces[min(pieces)]
                if lays == {"flat"}:
                    seen.setdefault("flat", (p.file, p.key, tuple(p.tensor.shape)))
                elif lays == {"whole"} and len(pieces) == 1 and g.sharding > 1:
                    seen.setdefault("whole", (p.file, p.key, tuple(p.tensor.shape)))
    if len(seen) == 2:
        (f1, k1, s1), (f2, k2, s2) = seen["whole"], seen["flat"]
        raise FormatError(
            f"mixed sharding strategies: {f1} holds {k1!r} whole {s1} (stage1 v1 / stage2) but "
            f"{f2} holds {k2!r} as a flat slice {s2} (stage1 v2 / stage3)"
        )
    if g.meta is not None and "flat" in seen:
        for k, m in (g.meta.get("sharding_metas") or {}).items():
            if isinstance(m, Mapping) and m.get("sharding_strategy") == "ShardingV1":
                f, key, s = seen["flat"]
                raise FormatError(
                    f"mixed sharding strategies: {MODEL_META} says ShardingV1 for {k} but {f} holds "
                    f"{key!r} as a flat slice {s}"
                )


# -- open ------------------------------------------------------------------------------------------


def detect(path: str) -> bool:
    if os.path.isfile(path):
        return path.endswith(".pdparams")
    if not os.path.isdir(path):
        return False
    return any(_MODEL_RE.match(f) or _OPT_RE.match(f) for f in os.listdir(path))


def _betas(folder: str) -> tuple[tuple[float, float], str | None]:
    """(beta1, beta2) from training_args.bin (a pickled PaddleNLP TrainingArguments, read as a
    stub), else the defaults and a note."""
    path = os.path.join(folder, "training_args.bin")
    if os.path.isfile(path):
        try:
            args = paddle_save.safe_load(path)
            b1, b2 = getattr(args, "adam_beta1", None), getattr(args, "adam_beta2", None)
            if isinstance(b1, float) and isinstance(b2, float):
                return (b1, b2), None
        except HybridCkptError:
            pass
    return (
        DEFAULT_BETAS,
        f"optimizer step derived assuming betas {DEFAULT_BETAS} (Paddle's defaults)",
    )


def _hf_rule_vars(cfg, tensors) -> dict:
    """The variables `paddle_llama.rules` uses, for this config and these (fused?) tensors."""
    return {k: v for k, v in llama_variables(cfg, **fused_flags(tensors)).items() if k in HF_RULE_VARS}


def _open_file(path: str, config) -> SourceCheckpoint:
    d = paddle_save.read(path)
    folder = os.path.dirname(path) or "."
    tensors = {k: as_model_dtype(t) for k, t in d.tensors.items()}
    cfg = load_config(folder, config)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        hf_rules=rules_text("paddle_llama.rules"),
        rule_vars=_hf_rule_vars(cfg, tensors),
        config=cfg,
    )


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """A PaddleNLP checkpoint folder (or one `.pdparams`) as lazy global tensors."""
    if os.path.isfile(path):
        return _open_file(path, config)
    g = scan(path)
    cfg = load_config(path, config)
    tprules = tp_rules(cfg, g.tp)
    groups = {
        (t, p): _read_group(g, t, p, cfg.num_layers) for p in range(g.pp) for t in range(g.tp)
    }
    _check_strategies(g, groups)
    model_dtype = config_dtype(path)
    notes: list[str] = []

    def local(grp: _Group, n: str, kind: str) -> LazyTensor | None:
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
                        beta_pows[kind].append(_scalar(pieces[min(pieces)].tensor))
            merged = {}
            for kind, shards in per_tp.items():
                try:
                    merged[kind] = tprules.merge_tp(n, shards)
                except (FormatError, MappingError) as e:  # name the files: the rule cannot
                    files = [_source_files(groups[(t, p)], n, kind) for t in range(g.tp)]
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
        trainer["lr_scheduler"] = _jsonable(first.extra["LR_Scheduler"])
    if slots or master:
        step, hyper = adam_step(path, beta_pows, notes)
        optimizer = OptimizerState(slots=slots, step=step, master=master, hyper=hyper)
    global_step = None
    ts = os.path.join(path, "trainer_state.json")
    if os.path.isfile(ts):
        state = read_json(ts)
        global_step = state.get("global_step")
        trainer.update({k: _jsonable(v) for k, v in state.items() if k != "log_history"})
    if g.ignored:
        notes.append(f"not read: {', '.join(g.ignored)}")
    strategy = "none"
    if g.sharding > 1:
        flat = any(
            _layout(pc, grp.shapes[n]) == "flat"
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
        hf_rules=rules_text("paddle_llama.rules"),
        rule_vars=_hf_rule_vars(cfg, tensors),
        config=cfg,
        step=global_step if global_step is not None else (optimizer.step if optimizer else None),
        topology={"tp": g.tp, "pp": g.pp, "sharding": g.sharding},
        trainer={**trainer, "sharding_layout": strategy},
        notes=tuple(notes),
    )
