"""Legacy Hugging Face torch shards: `pytorch_model.bin`, or `pytorch_model-0000i-of-0000N.bin`
with or without `pytorch_model.bin.index.json`.

Layout (transformers 4.x `save_pretrained(safe_serialization=False)`, modeling_utils.py; 5.x no
longer writes it, many older hub repos hold nothing else):
- each file is a `torch.save` zip of a flat state dict `{name: tensor}` (read through the
  restricted unpickler, `containers.pickle.torch_save`: no code runs, tensor bytes are byte
  ranges of the file);
- sharded: `pytorch_model-{i:05d}-of-{N:05d}.bin` (i from 1) and the index
  `{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`; a folder whose index was
  lost is read from the shard names alone (all N present, each name in one shard);
- a tied head: the state dict holds `lm_head.weight` as a view of the embedding's storage
  (`model.embed_tokens.weight`, `transformer.wte.weight`): both names are listed, their bytes
  are one storage (read once: the family's rules drop the tied copy; `tied_copies` names them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError, short_repr
from hybridckpt.lazy import LazyTensor, full_box

SINGLE = "pytorch_model.bin"
INDEX = "pytorch_model.bin.index.json"
SHARD_RE = re.compile(r"^pytorch_model-(?P<i>\d{5})-of-(?P<n>\d{5})\.bin$")
MAX_SHARDS = 100_000


def present(folder: str) -> bool:
    """Whether `folder` holds torch shards of an HF model (single, indexed or bare shards)."""
    if os.path.isfile(os.path.join(folder, SINGLE)) or os.path.isfile(os.path.join(folder, INDEX)):
        return True
    try:
        return any(SHARD_RE.match(f) for f in os.listdir(folder))
    except OSError:
        return False


def _state_dict(path: str) -> dict[str, LazyTensor]:
    return tensors_of(torch_save.load(path), path)


def tensors_of(obj: object, where: str) -> dict[str, LazyTensor]:
    """A flat state dict `{name: tensor}` unpickled from `where`, checked to be one (names are
    strings, values tensors): else a FormatError naming the first entry that is not."""
    if not isinstance(obj, Mapping):
        raise FormatError(f"{where}: expected a state dict (name -> tensor), found {type(obj).__name__}")
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, LazyTensor):
            raise FormatError(f"{where}: entry {short_repr(k)}: expected a tensor under a str name, found {type(v).__name__}")
        out[k] = v
    return out


def _bare_shards(folder: str) -> list[str]:
    """The shard files of a folder without an index, checked to be the full set 1..N."""
    names = sorted(f for f in os.listdir(folder) if SHARD_RE.match(f))
    counts = {SHARD_RE.match(f).group("n") for f in names}
    if len(counts) != 1:
        raise FormatError(f"{folder}: torch shards of different counts {sorted(counts)}: {names[:4]}")
    n = int(counts.pop())
    want = [f"pytorch_model-{i:05d}-of-{n:05d}.bin" for i in range(1, n + 1)] if 0 < n <= MAX_SHARDS else []
    if names != want:
        missing = sorted(set(want) - set(names))
        raise FormatError(f"{folder}: expected shards 1..{n} of pytorch_model-*-of-{n:05d}.bin, missing {missing[:4]} "
                          f"(found {names[:4]})")
    return names


def read(folder: str, weight_map: Mapping[str, str] | None) -> tuple[dict[str, LazyTensor], str]:
    """(tensors of every torch shard in `folder`, how they were found: "pytorch_model.bin",
    "N shards by pytorch_model.bin.index.json" or "N shards by their names (no index)");
    `weight_map`: the index's (`formats.hf.read_index`, file names checked), None without one."""
    index_path = os.path.join(folder, INDEX)
    if weight_map is not None:
        files = list(dict.fromkeys(weight_map.values()))
        how = f"{len(files)} torch shard(s) by {INDEX}"
    elif os.path.isfile(os.path.join(folder, SINGLE)):
        files, how = [SINGLE], SINGLE
    else:
        files = _bare_shards(folder)
        how = f"{len(files)} torch shard(s) by their names (no {INDEX})"
    out: dict[str, LazyTensor] = {}
    where: dict[str, str] = {}
    for fname in files:
        fpath = os.path.join(folder, fname)
        if not os.path.isfile(fpath):
            raise FormatError(f"{index_path}: names {fname}, which is missing")
        for name, t in _state_dict(fpath).items():
            if name in out:
                raise FormatError(f"{folder}: tensor {short_repr(name)} is in both {where[name]} and {fname}")
            if weight_map is not None and weight_map.get(name) != fname:
                raise FormatError(f"{fpath}: holds {short_repr(name)}, which {INDEX} puts in "
                                  f"{short_repr(weight_map.get(name))}")
            out[name], where[name] = t, fname
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise FormatError(f"{index_path}: tensors {missing[:5]} are in no shard")
    return out, how


def tied_copies(tensors: Mapping[str, LazyTensor]) -> dict[str, str]:
    """{name: the earlier name whose bytes it is}: tensors that view the very same stored bytes
    (a tied head saved as a view of the embedding's storage). Nothing is read."""
    seen: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for name, t in tensors.items():
        runs = t.file_runs(full_box(t.shape), 4) if t.size else None
        if not runs:
            continue
        key = (tuple(t.shape), str(t.dtype), tuple((getattr(r.source, "path", id(r.source)), r.offset, r.nbytes) for r in runs))
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out
