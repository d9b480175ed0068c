"""The files of a PaddleNLP hybrid-parallel checkpoint folder, and what its metadata says.

Format (PaddlePaddle/PaddleNLP: paddlenlp/trainer/trainer.py, trainer/utils/sharding_io.py):
- `model_state[.SFX].pdparams` per (tp, pp), or per (tp, pp, shard) with `save_sharded_model`;
  `optimizer[.SFX].pdopt` per (tp, pp, shard). SFX is `tpNN` (tp > 1), `ppNN` (pp > 1),
  `shardNN` (sharding > 1) joined by `_`; degrees are max rank + 1 (or `model_meta.json`
  `parallel_config`), and every file of the grid must exist (`scan`).
- `model_meta.json` (optional): `parallel_config` {mp_degree, pp_degree, sharding_degree},
  `sharding_metas.tpXX_ppYY` {structure_name_mapping, param_meta: {name: [shape, dtype id]},
  sharding_strategy}; dtype ids are Paddle 2.x (FP16=4, FP32=5, BF16=22) or 3.x (FLOAT32=10,
  FLOAT16=15, BFLOAT16=16), which do not overlap for float types (`META_DTYPES`).
- `config.json`: HF-style keys plus the model `"dtype"` (`config_dtype`).
- bf16 is stored as uint16 bits: model params of dtype uint16 are viewed as bfloat16
  (`as_model_dtype`); moments and master weights are fp32.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from hybridckpt.containers.pickle import paddle_save
from hybridckpt.errors import FormatError
from hybridckpt.io.config_file import read_json
from hybridckpt.lazy import LazyTensor

MODEL_META = "model_meta.json"
BF16 = np.dtype(ml_dtypes.bfloat16)

MODEL_RE = re.compile(r"^model_state(?:\.(?P<sfx>[A-Za-z0-9_]+))?\.pdparams$")
OPT_RE = re.compile(r"^optimizer(?:\.(?P<sfx>[A-Za-z0-9_]+))?\.pdopt$")
_SFX_RE = re.compile(r"^(tp|pp|shard)(\d+)$")
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


# -- the grid of files ------------------------------------------------------------------------------


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


def file_suffix(g: Grid, tp: int, pp: int, shard: int | None) -> str:
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
        m, o = MODEL_RE.match(fname), OPT_RE.match(fname)
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
        check_meta(meta, os.path.join(folder, MODEL_META))
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
                            f"{folder}: missing optimizer{file_suffix(g, t, p, s)}.pdopt "
                            f"(the checkpoint has tp {tp}, pp {pp}, sharding {sharding})"
                        )
            files = model.get((t, p), {})
            sharded = [s for s in files if s is not None]
            if sharded and len(sharded) < sharding:
                miss = min(set(range(sharding)) - set(sharded))
                raise FormatError(f"{folder}: missing model_state{file_suffix(g, t, p, miss)}.pdparams")
            if not files and not optimizer:
                raise FormatError(f"{folder}: missing model_state{file_suffix(g, t, p, None)}.pdparams")
            if not files and meta is None:
                raise FormatError(
                    f"{folder}: missing model_state{file_suffix(g, t, p, None)}.pdparams, and there is no "
                    f"{MODEL_META} to name the optimizer's parameters"
                )
    return g



def check_meta(meta: dict, path: str) -> None:
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
