"""ColossalAI distributed checkpoints: per-rank weight files plus offsets/lengths metadata.

Format (hpcaitech/ColossalAI PR #6181, never released: its head 7e880a13 is colossalai 0.4.7 with
`colossalai/checkpoint_io/distributed_checkpoint_utils.py` `create_model_metadata`,
`save_metadata`, `get_dist_meta_file_name`; `booster.save_model(..., gather_dtensor=False)`), as the
files that code writes show (tests/real/generators/colossalai.py, HybridParallelPlugin tp 2):
- One metadata file per model-parallel rank `dist_id = tp_size * pp_rank + tp_rank`:
  `pytorch_model-meta-dist-{dist_id:05d}.index.json` when the weights are safetensors, `.json`
  when they are `.bin` (the suffix follows `use_safetensors`, sharded or not):
  `{"checkpoint_version": "1.0", "total_size": MB as a float (null unsharded), "metadata": {name:
  {"offsets": [..], "lengths": [..], "global_shape": [..], "file": weight file, "rank": global
  rank}}}`.
- Weight files: sharded `pytorch_model-dist-{id:05d}-shard-{i:05d}.bin` /
  `model-dist-{id:05d}-shard-{i:05d}.safetensors` (i from 0), recorded by bare name; unsharded
  `pytorch_model-dist-{id:05d}.bin`, recorded as the path `save_model` was given joined with that
  name (`weight_file_name` reads the name inside the folder). State dicts of the rank's local
  params under the model's own (HF) names. No config.json is written: pass the model's config.
- A piece is the box `[offsets, offsets + lengths)` of the global tensor. Offsets are non-zero
  only on the TP dim (`partition_size * tp_rank`). The code trims `lengths` on the last TP rank for
  a padded dim, but its own `search_tp_partition_dim` asserts an even split, so a padded vocab
  fails the save (AssertionError "isn't evenly distributed"): real pieces are whole local
  tensors. A stored tensor larger than `lengths` is still read as its leading block.
- Only model params (the PR leaves the optimizer's IO as released).

Every global tensor is assembled lazily from its pieces (a grid of boxes joined by `Concat`,
replicas taken once); gaps, overlaps and pieces past `global_shape` are FormatErrors naming the
tensor and the files. Names are the model's own, so for HF models `hf_rules` is empty.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import FormatError
from hybridckpt.io.config_file import config_beside, read_json
from hybridckpt.io.paths import plain_name
from hybridckpt.lazy import LazyTensor
from hybridckpt.source_checkpoint import SourceCheckpoint

NAME = "colossal"
META_RE = re.compile(r"^pytorch_model-meta-dist-(?P<id>\d+)(?:\.index)?\.json$")


@dataclass(frozen=True)
class Piece:
    """`tensor` is the box `[offsets, offsets + lengths)` of a global tensor; `where` names it."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    tensor: LazyTensor
    where: str


def detect(path: str) -> bool:
    return os.path.isdir(path) and any(META_RE.match(f) for f in os.listdir(path))


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise FormatError(f"{what}: expected a list of ints, found {value!r}")
    return tuple(value)


def assemble(name: str, pieces: Sequence[Piece], shape: Sequence[int]) -> LazyTensor:
    """The global tensor `name` of `shape` from pieces that tile it exactly (replicas allowed)."""
    shape = tuple(shape)
    uniq: dict[tuple, Piece] = {}
    for p in pieces:
        if len(p.offsets) != len(shape) or len(p.lengths) != len(shape):
            raise FormatError(
                f"{p.where}: {name!r} has {len(p.offsets)}-d offsets for a {len(shape)}-d tensor {shape}"
            )
        if any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(p.offsets, p.lengths, shape, strict=True)
        ):
            raise FormatError(
                f"{p.where}: {name!r} piece at offsets {list(p.offsets)} lengths {list(p.lengths)} "
                f"lies outside global_shape {list(shape)}"
            )
        uniq.setdefault((p.offsets, p.lengths), p)
    return _tile(name, list(uniq.values()), tuple((0, s) for s in shape))


def _tile(name: str, pieces: list[Piece], box: tuple[tuple[int, int], ...]) -> LazyTensor:
    files = sorted({p.where for p in pieces})
    if len(pieces) == 1:
        p = pieces[0]
        have = tuple((o, o + n) for o, n in zip(p.offsets, p.lengths, strict=True))
        if have != box:
            raise FormatError(
                f"{name!r}: the pieces leave a gap: region {[list(b) for b in box]} is covered only by "
                f"{[list(b) for b in have]} ({p.where})"
            )
        return p.tensor
    for axis, (lo, hi) in enumerate(box):
        spans = sorted({(p.offsets[axis], p.offsets[axis] + p.lengths[axis]) for p in pieces})
        if len(spans) == 1:
            continue
        parts, pos = [], lo
        for a, b in spans:
            if a != pos:
                kind = "overlap" if a < pos else "gap"
                raise FormatError(
                    f"{name!r}: pieces {kind} on dim {axis} at {min(a, pos)}..{max(a, pos)} "
                    f"(spans {spans}; files {files})"
                )
            group = [
                p for p in pieces if (p.offsets[axis], p.offsets[axis] + p.lengths[axis]) == (a, b)
            ]
            sub = box[:axis] + ((a, b),) + box[axis + 1 :]
            parts.append(_tile(name, group, sub))
            pos = b
        if pos != hi:
            raise FormatError(
                f"{name!r}: pieces end at {pos} on dim {axis}, global size is {hi} (files {files})"
            )
        return lazy.concat(parts, axis)
    raise FormatError(f"{name!r}: {len(pieces)} different pieces claim the same region ({files})")


def weight_file_name(fname: str, folder: str, meta_path: str) -> str:
    """The weight file's name inside `folder` for a metadata `file` entry.

    Sharded saves record the shard's bare name. The unsharded save records the path its
    `save_model` call was given joined with the file name (`ckpt/pytorch_model-dist-00000.bin`
    for `save_model(model, "ckpt")`), which says where the saving process stood, not where the
    folder is now: only its last component is used, and only a file of that name in `folder`
    is read (nothing outside the folder, whatever the path says)."""
    if not isinstance(fname, str):
        raise FormatError(f"{meta_path}: weight file {fname!r} is not a file name")
    name = plain_name(fname.replace("\\", "/").split("/")[-1], meta_path, "weight file")
    if not os.path.isfile(os.path.join(folder, name)):
        raise FormatError(f"{meta_path}: weight file {fname!r} is missing")
    return name


class _Files:
    """Weight files opened once each: name -> lazy tensor."""

    def __init__(self, folder: str):
        self.folder = folder
        self.cache: dict[str, Mapping[str, LazyTensor]] = {}

    def get(self, fname: str, meta_path: str) -> Mapping[str, LazyTensor]:
        fname = weight_file_name(fname, self.folder, meta_path)
        if fname not in self.cache:
            path = os.path.join(self.folder, fname)
            if fname.endswith(".safetensors"):
                tensors = read_header(path).tensors
            else:
                obj = torch_save.load(path)
                if not isinstance(obj, Mapping):
                    raise FormatError(f"{path}: expected a state dict, found {type(obj).__name__}")
                tensors = {k: v for k, v in obj.items() if isinstance(v, LazyTensor)}
            self.cache[fname] = tensors
        return self.cache[fname]


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """A ColossalAI distributed checkpoint folder as lazy global tensors (model params only)."""
    metas = sorted(f for f in os.listdir(path) if META_RE.match(f))
    if not metas:
        raise FormatError(f"{path}: no pytorch_model-meta-dist-*.json files")
    files = _Files(path)
    pieces: dict[str, list[Piece]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    ranks = set()
    for mname in metas:
        mpath = os.path.join(path, mname)
        doc = read_json(mpath)
        entries = doc.get("metadata")
        if not isinstance(entries, dict):
            raise FormatError(
                f"{mpath}: expected {{'metadata': {{name: {{offsets, lengths, global_shape, file}}}}}}"
            )
        ranks.add(int(META_RE.match(mname).group("id")))
        for name, item in entries.items():
            what = f"{mpath}: {name!r}"
            if not isinstance(item, dict) or not isinstance(item.get("file"), str):
                raise FormatError(
                    f"{what}: expected offsets, lengths, global_shape and file, found {item!r}"
                )
            offsets = _ints(item.get("offsets"), f"{what} offsets")
            lengths = _ints(item.get("lengths"), f"{what} lengths")
            shape = _ints(item.get("global_shape"), f"{what} global_shape")
            if len(offsets) != len(shape) or len(lengths) != len(shape):
                raise FormatError(
                    f"{what}: offsets {list(offsets)} and lengths {list(lengths)} do not have the "
                    f"{len(shape)} dims of global_shape {list(shape)}"
                )
            if min(offsets + lengths + shape, default=0) < 0:
                raise FormatError(
                    f"{what}: negative offsets {list(offsets)}, lengths {list(lengths)} or "
                    f"global_shape {list(shape)}"
                )
            if shapes.setdefault(name, shape) != shape:
                raise FormatError(
                    f"{what}: global_shape {list(shape)} disagrees with {list(shapes[name])} elsewhere"
                )
            stored = files.get(item["file"], mpath).get(name)
            wfile = os.path.join(path, weight_file_name(item["file"], path, mpath))
            if stored is None:
                raise FormatError(f"{wfile}: {mpath} says it holds {name!r} but it does not")
            if stored.ndim != len(shape) or any(
                n > s for n, s in zip(lengths, stored.shape, strict=True)
            ):
                raise FormatError(
                    f"{wfile}: {name!r} is stored with shape {tuple(stored.shape)}, smaller than its "
                    f"lengths {list(lengths)} in {mname}"
                )
            t = (
                lazy.Slice(stored, tuple((0, n) for n in lengths))
                if tuple(lengths) != tuple(stored.shape)
                else stored
            )
            pieces.setdefault(name, []).append(Piece(offsets, lengths, t, wfile))
    for name in pieces:  # before assembling: joining pieces of two dtypes names no file
        dts = {str(np.dtype(p.tensor.dtype)) for p in pieces[name]}
        if len(dts) > 1:
            raise FormatError(
                f"{name!r}: pieces have different dtypes {sorted(dts)} ({[p.where for p in pieces[name]]})"
            )
    tensors = {name: assemble(name, ps, shapes[name]) for name, ps in pieces.items()}
    cfg = config_beside(path, config=config)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        hf_rules="",
        config=cfg,
        topology={"model_parallel_ranks": len(ranks)},
    )
