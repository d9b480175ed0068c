"""One (tp, pp) rank group of a PaddleNLP hybrid-parallel checkpoint, and its sharding pieces.

A group is everything the files of one (tp, pp) saved, under structured names: model params
(`model_state` files, PipelineLayer keys renamed to single-card names), their shapes and dtypes
(from the params, else `model_meta.json` `param_meta`), and the optimizer's accumulators and
master weights by sharding rank. `param.name`s restart on every rank: an accumulator
`<param.name>..._<acc>_N` is matched to its structured name only through the name table of its
own (tp, pp) (`StructuredToParameterName@@` in the model_state files, or `model_meta.json`
`sharding_metas.tpXX_ppYY.structure_name_mapping`). Master weights are `master_weights:
{param.name: fp32}` (stage 3: `slice@<param.name>`).

Sharding (`stitch`): stage1 v1 / stage2 give whole params to one rank (merge = union); stage1 v2
packs params padded into flat buffers split evenly over ranks, each rank keeping a 1-D slice
(padding included); stage3 slices large params evenly. Both flat layouts rebuild the same way:
the 1-D pieces in sharding-rank order, concatenated, `[:numel]`, reshaped to the local shape. A
checkpoint mixing whole and flat layouts, or `model_meta.json` strategies, is refused
(`check_strategies`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.pickle import paddle_save
from hybridckpt.errors import FormatError
from hybridckpt.formats.paddle.files import META_DTYPES, MODEL_META, Grid, as_model_dtype
from hybridckpt.formats.paddle.optimizer import ACCUMULATOR_RE, BETA_POWS, SLOT_OF_ACCUMULATOR
from hybridckpt.formats.paddle.rules import single_card_name
from hybridckpt.lazy import LazyTensor


@dataclass
class Piece:
    """A tensor as one file stored it: `tensor` read from `file` under `key`."""

    tensor: LazyTensor
    file: str
    key: str


@dataclass
class Group:
    """Everything one (tp, pp) rank group saved, under structured names."""

    model: dict[str, Piece] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    # name -> kind (an accumulator: moment1, ..., beta1_pow_acc, ...; or master) -> shard -> piece
    states: dict[str, dict[str, dict[int, Piece]]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def _meta_for(g: Grid, tp: int, pp: int) -> Mapping | None:
    if g.meta is None:
        return None
    metas = g.meta.get("sharding_metas") or {}
    return metas.get(f"tp{tp:02d}_pp{pp:02d}")


def read_group(g: Grid, tp: int, pp: int, num_layers: int, prefix: str) -> Group:
    grp = Group()
    meta = _meta_for(g, tp, pp)

    def rename(k: str) -> str:
        return single_card_name(k, num_layers, pp, prefix)

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
            grp.model[n] = Piece(as_model_dtype(t), path, k)
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
            _add_state(grp, by_param, m.group("p"), m.group("acc"), shard, Piece(t, path, k), path)
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
                    Piece(t, path, f"master_weights/{k}"),
                    path,
                )
    return grp


def source_files(grp: Group, n: str, kind: str) -> list[str]:
    """The files one tp rank's tensor `n` of `kind` (model, an accumulator, master) came from."""
    if kind == "model":
        return [grp.model[n].file] if n in grp.model else []
    return sorted({p.file for p in grp.states.get(n, {}).get(kind, {}).values()})



def _add_state(
    grp: Group, by_param, pname: str, kind: str, shard: int, piece: Piece, path: str
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


def piece_layout(piece: Piece, shape: tuple[int, ...]) -> str:
    if tuple(piece.tensor.shape) == tuple(shape):
        return "whole"
    if piece.tensor.ndim == 1:
        return "flat"
    return "bad"


def stitch(
    name: str, kind: str, pieces: Mapping[int, Piece], shape: tuple[int, ...] | None
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
    layouts = {r: piece_layout(pieces[r], shape) for r in ranks}
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


def check_strategies(g: Grid, groups: Mapping[tuple[int, int], Group]) -> None:
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
                lays = {piece_layout(p, shape) for p in pieces.values()}
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
