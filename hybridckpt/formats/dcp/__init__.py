"""PyTorch Distributed Checkpoint (DCP) folders: FSDP2, DTensor tensor parallel, torchtitan.

Layout (pytorch/pytorch: torch/distributed/checkpoint/{metadata,filesystem,hf_storage}.py):
- `.metadata` (or rank-local `__{rank}.metadata` from `use_collectives=False`): see
  `hybridckpt.io.dcp_metadata`. Data in `__{rank}_{n}.distcp`: every tensor chunk is a complete
  `torch.save` zip archive of the local block (shape = chunk sizes) at bytes
  `[offset, offset + length)`; byte items (param-group values, ...) are `torch.save`d objects.
  Chunks carry GLOBAL offsets; with dp x tp they are not in rank order (a q_proj over 4 ranks
  can sit at rows 0, 32, 16, 48): the offsets are trusted, never the rank order.
- With `FileSystemWriter(serialization_format=SAFETENSORS)` a `.distcp` file is instead one
  safetensors blob keyed by fqn (offsets from its `DCP_SHARDING_INFO`); the `.metadata` byte
  ranges do not locate the data then, the safetensors header does.
- Safetensors variant (`HuggingFaceStorageWriter(save_distributed=True)`, no `.metadata`):
  `shard-{rank:05d}-model-{i:05d}-of-{n:05d}.safetensors` files, each tensor a chunk whose
  global offsets are `json.loads(__metadata__["DCP_SHARDING_INFO"])[fqn]["saved_offsets"]`;
  the global shape is the maximum of `offset + size` per dim (as torch's reader computes it).

Structure: keys are the flattened state-dict paths the saving code chose. Optimizer state is
`<opt>state.<fqn>.<slot>`: every slot the optimizer keeps under torch's own name (Adam's
`exp_avg`, `exp_avg_sq`; SGD's `momentum_buffer`; see `torch_optim`) and `.step` (0-d); the
optimizer prefix `<opt>` and the model prefix `<model>` (where `<model><fqn>` is the param) are
the pair that explains most state keys (`optim.` / `model.` for `get_state_dict`, `optimizer.` /
`` for torchtitan). Without optimizer state the model prefix comes from `planner_data` paths. Param groups
are `<opt>param_groups.N.{lr, betas, eps, weight_decay, params}`, or per fqn
`<opt>param_groups.<fqn>.lr` when the optimizer state was flattened (torch's
`flatten_optimizer_state_dict`, as torchtitan saves it).

Names after the model prefix are the model's own: HF names for HF models (`hf_rules` empty), or
torchtitan Llama names (`tok_embeddings`, `layers.N.attention.wq`, ...) mapped by
`rules/torchtitan_llama.rules`.
"""

from __future__ import annotations

import builtins
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from hybridckpt.errors import FormatError
from hybridckpt.formats import torch_optim
from hybridckpt.formats.config_file import config_beside, parse_json
from hybridckpt.formats.rules_files import rules_text
from hybridckpt.formats.torch_optim import STEP, check_complete
from hybridckpt.io.dcp_metadata import (
    Chunk,
    DcpMetadata,
    TensorEntry,
    check_tiling,
    metadata_files,
    read_metadata,
)
from hybridckpt.io.pickle import torch_save
from hybridckpt.io.safetensors_file import read_header
from hybridckpt.lazy import Box, FileRun, LazyTensor, block_overlap, tiled_file_runs
from hybridckpt.source import OptimizerState, SourceCheckpoint

NAME = "dcp"
_HF_SHARD = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")
_SHARDING_KEY = "DCP_SHARDING_INFO"  # torch/distributed/checkpoint/_hf_utils.py


# -- lazy views ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TorchSaveChunk(LazyTensor):
    """A block saved with `torch.save` at `[offset, offset + length)` of `path`.

    The archive's zip directory and pickle are parsed on the first read (not at open time), then
    only the bytes of each box are read. `shape`, `dtype` as the metadata says; the archive
    must agree."""

    path: str
    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: np.dtype
    fqn: str = ""
    _cache: dict = field(default_factory=dict, repr=False)  # the parsed archive, once

    def tensor(self) -> LazyTensor:
        t = self._cache.get("t")
        if t is None:  # two threads may both parse it: harmless, same result
            t = torch_save.load(self.path, base_offset=self.offset, length=self.length)
            what = f"{self.path}@{self.offset}+{self.length} ('{self.fqn}')"
            if not isinstance(t, LazyTensor):
                raise FormatError(f"{what}: chunk holds {type(t).__name__}, not a tensor")
            if tuple(t.shape) != self.shape or np.dtype(t.dtype) != np.dtype(self.dtype):
                raise FormatError(
                    f"{what}: chunk is {t.dtype} {t.shape}, the metadata says "
                    f"{self.dtype} {self.shape}"
                )
            self._cache["t"] = t
        return t

    def read_box(self, box: Box) -> np.ndarray:
        return self.tensor().read_box(box)

    def read_into(self, box: Box, out: np.ndarray) -> None:
        self.tensor().read_into(box, out)

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        return self.tensor().file_runs(box, limit)


@dataclass(frozen=True, eq=False)
class Tiled(LazyTensor):
    """A global tensor made of blocks: `pieces` are `(offsets, block)` that tile `shape` exactly
    (checked by the caller). A box reads only the blocks it intersects, each only the overlap."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[tuple[tuple[int, ...], LazyTensor], ...]

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """Each intersecting block fills its own slab of `out` (no intermediate copy)."""
        if out.size == 0:
            return
        for offs, block in self.pieces:
            sub = block_overlap(box, offs, block.shape)
            if sub is not None:
                dst = tuple(slice(o + s - a, o + e - a) for (s, e), o, (a, _) in zip(sub, offs, box, strict=True))
                block.read_into(sub, out[dst])

    def file_runs(self, box: Box, limit: int) -> list[FileRun] | None:
        return tiled_file_runs(box, self.pieces, limit)


def tiled(entry_shape: tuple[int, ...], dtype, pieces) -> LazyTensor:
    """`Tiled`, or the single block itself when one block is the whole tensor."""
    pieces = tuple((tuple(o), b) for o, b in pieces)
    if len(pieces) == 1 and pieces[0][1].shape == tuple(entry_shape):
        return pieces[0][1]
    return Tiled(tuple(entry_shape), np.dtype(dtype), pieces)


# -- detection ----------------------------------------------------------------------------------


def _hf_shards(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if _HF_SHARD.match(n)]


def _has_sharding_info(path: str) -> bool:
    try:
        return _SHARDING_KEY in read_header(path).metadata
    except FormatError:
        return False


def detect(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if metadata_files(path):
        return True
    shards = _hf_shards(path)
    return bool(shards) and _has_sharding_info(shards[0])


# -- reading ------------------------------------------------------------------------------------


def _check_files(md: DcpMetadata) -> None:
    sizes: dict[str, int] = {}
    used = [(e.fqn, c.path, c.offset, c.length) for e in md.tensors.values() for c in e.chunks]
    used += [(b.fqn, b.path, b.offset, b.length) for b in md.bytes_items.values()]
    for fqn, path, offset, length in used:
        if path not in sizes:
            if not os.path.isfile(path):
                raise FormatError(
                    f"{path}: missing; {md.files[0]} stores '{fqn}' (and maybe more) in it"
                )
            sizes[path] = os.path.getsize(path)
        if offset + length > sizes[path]:
            raise FormatError(
                f"{path}: '{fqn}' is stored at bytes [{offset}, {offset + length}) but the file "
                f"has {sizes[path]} bytes (truncated?)"
            )


def _safetensors_blobs(md: DcpMetadata) -> dict[str, dict]:
    """Data files that are safetensors blobs (`FileSystemWriter(serialization_format=
    SAFETENSORS)`): path -> {fqn: (saved_offsets, StoredTensor)}. Their `.metadata` offsets and
    lengths do not locate the bytes (torch 2.13's own FileSystemReader cannot read them); the
    safetensors header does."""
    out: dict[str, dict] = {}
    for path in {c.path for e in md.tensors.values() for c in e.chunks}:
        with builtins.open(path, "rb") as f:
            head = f.read(9)
        if len(head) < 9 or head[8:9] != b"{":
            continue
        st = read_header(path)
        raw = st.metadata.get(_SHARDING_KEY)
        if raw is None:
            continue
        info = _sharding_info(path, raw)
        out[path] = {fqn: (_saved_offsets(info, fqn, path) or (), t) for fqn, t in st.tensors.items()}
    return out


def _sharding_info(path: str, raw: str) -> dict:
    return parse_json(raw, f"{path}: {_SHARDING_KEY}")


def _saved_offsets(info: dict, fqn: str, path: str) -> tuple[int, ...] | None:
    """`info[fqn]["saved_offsets"]` checked to be non-negative ints; None when `fqn` is absent."""
    entry = info.get(fqn)
    if entry is None:
        return None
    offs = entry.get("saved_offsets") if isinstance(entry, dict) else None
    if not isinstance(offs, list) or not all(
        isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs
    ):
        raise FormatError(
            f"{path}: {_SHARDING_KEY}['{fqn}'] saved_offsets is {offs!r}, expected a list of "
            f"non-negative ints"
        )
    return tuple(offs)


def _chunk(e: TensorEntry, c: Chunk, blobs: Mapping[str, dict]) -> LazyTensor:
    if c.path not in blobs:
        return TorchSaveChunk(c.path, c.offset, c.length, c.sizes, e.dtype, e.fqn)
    offs, t = blobs[c.path].get(e.fqn, (None, None))
    if t is None or offs != c.offsets or t.shape != c.sizes or np.dtype(t.dtype) != e.dtype:
        found = "nothing" if t is None else f"{t.dtype} {t.shape} at offsets {offs}"
        raise FormatError(
            f"{c.path}: safetensors entry '{e.fqn}' should be {e.dtype} {c.sizes} at offsets "
            f"{c.offsets}; found {found}"
        )
    return t


def _entry_tensor(e: TensorEntry, blobs: Mapping[str, dict] = MappingProxyType({})) -> LazyTensor:
    pieces = [
        (c.offsets, _chunk(e, c, blobs))
        for c in e.chunks
        if math.prod(c.sizes) > 0 or len(e.chunks) == 1
    ]
    return tiled(e.shape, e.dtype, pieces)


def _read_hf_shards(folder: str, shards: list[str]) -> dict[str, LazyTensor]:
    """Global tensors of the safetensors variant, from each file's DCP_SHARDING_INFO offsets."""
    blocks: dict[str, list[tuple[tuple[int, ...], LazyTensor, str]]] = {}
    for path in shards:
        st = read_header(path)
        raw = st.metadata.get(_SHARDING_KEY)
        if raw is None:
            raise FormatError(f"{path}: no {_SHARDING_KEY} in the safetensors metadata")
        info = _sharding_info(path, raw)
        for fqn, t in st.tensors.items():
            offs = _saved_offsets(info, fqn, path)
            if offs is None or len(offs) != t.ndim:
                raise FormatError(f"{path}: '{fqn}' has no saved_offsets of {t.ndim} dims")
            blocks.setdefault(fqn, []).append((offs, t, path))
    out = {}
    for fqn, parts in blocks.items():
        nd = parts[0][1].ndim
        shape = tuple(max(o[i] + t.shape[i] for o, t, _ in parts) for i in range(nd))
        dtypes = {np.dtype(t.dtype) for _, t, _ in parts}
        if len(dtypes) != 1:
            raise FormatError(f"{folder}: '{fqn}' chunks have dtypes {sorted(map(str, dtypes))}")
        chunks = [Chunk(o, t.shape, p, 0, 0) for o, t, p in parts]
        check_tiling(fqn, shape, chunks, folder)
        out[fqn] = tiled(shape, dtypes.pop(), [(o, t) for o, t, _ in parts])
    return out


def _load_item(md: DcpMetadata, fqn: str):
    b = md.bytes_items[fqn]
    return torch_save.load(b.path, base_offset=b.offset, length=b.length)


# -- structure ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Structure:
    """Where things are in the flattened keys: `model` prefix (params are `model + fqn`) and
    `optim` prefix (per-parameter state `optim + "state." + fqn + "." + slot`); None when absent."""

    model: str
    optim: str | None


def _state_split(key: str) -> list[tuple[str, str]]:
    """Candidate (optimizer prefix, fqn) splits of `<opt>state.<fqn>.<slot>`, longest fqn first."""
    body, dot, _slot = key.rpartition(".")
    if not dot:
        return []
    out = []
    for m in re.finditer(r"(?:^|\.)state\.", body):
        start = m.start() + (1 if m.group().startswith(".") else 0)
        if body[start + len("state.") :]:
            out.append((body[:start], body[start + len("state.") :]))
    return out


def find_structure(tensor_keys, planner_data: Mapping[str, tuple]) -> Structure:
    """The model and optimizer prefixes that explain the most per-parameter state keys (see
    module doc)."""
    keys = set(tensor_keys)
    splits = {k: _state_split(k) for k in sorted(keys)}
    splits = {k: v for k, v in splits.items() if v}
    # candidate (model, optim) prefix pairs from a few state keys, then a vote over all of them
    pairs: set[tuple[str, str]] = set()
    for cands in list(splits.values())[:8]:
        for opt, fqn in cands:
            for t in keys:
                if t.startswith(opt + "state.") or not t.endswith(fqn):
                    continue
                if len(t) == len(fqn) or t[-len(fqn) - 1] == ".":
                    pairs.add((t[: -len(fqn)], opt))
    votes = Counter()
    for model, opt in pairs:
        votes[(model, opt)] = sum(
            1 for cands in splits.values() for o, f in cands if o == opt and model + f in keys
        )
    if votes and votes.most_common(1)[0][1] > 0:
        best = max(votes.values())
        # ties: the shortest model prefix (fewest assumptions), then the shortest optimizer one
        model, opt = min(
            (p for p, v in votes.items() if v == best), key=lambda p: (len(p[0]), len(p[1]))
        )
        return Structure(model, opt)
    # no optimizer state: the common parent path of the tensors, as the planner recorded it
    parents = []
    for k in keys:
        path = planner_data.get(k)
        if path and ".".join(map(str, path)) == k:
            parents.append(tuple(path[:-1]))
    if parents and len(set(parents)) == 1 and parents[0]:
        return Structure(".".join(map(str, parents[0])) + ".", None)
    return Structure("", None)


_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "params")


def _param_groups(md: DcpMetadata, opt: str) -> list[dict]:
    """Param groups as dicts. Two layouts: `<opt>param_groups.N.<key>` (nested state dict) and
    `<opt>param_groups.<fqn>.<key>` (torch's flatten_optimizer_state_dict, torchtitan): the
    latter becomes one group per distinct set of values, with the fqns as `params`."""
    pre = opt + "param_groups."
    values: dict[str, dict] = {}
    for fqn in list(md.bytes_items) + list(md.tensors):
        if not fqn.startswith(pre):
            continue
        head, _, key = fqn[len(pre) :].rpartition(".")
        if key not in _HYPER_KEYS or not head:
            continue
        if fqn in md.tensors:
            if md.tensors[fqn].shape != ():
                continue
            value = float(_entry_tensor(md.tensors[fqn]).materialize())
        else:
            value = _load_item(md, fqn)
        values.setdefault(head, {})[key] = value
    if all(h.isdigit() for h in values):
        return [values[h] for h in sorted(values, key=int)]
    groups: list[dict] = []
    for fqn, v in values.items():
        hyper = {k: v[k] for k in _HYPER_KEYS if k in v and k != "params"}
        for g in groups:
            if {k: g[k] for k in hyper} == hyper:
                g["params"].append(fqn)
                break
        else:
            groups.append({**hyper, "params": [fqn]})
    return groups


# -- open ---------------------------------------------------------------------------------------


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def _is_torchtitan(names) -> bool:
    return any(n.startswith("tok_embeddings.") for n in names) or any(
        ".attention.wq." in n for n in names
    )


def _config(folder: str, config):
    return config_beside(folder, config=config)


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        raise FormatError(f"{path}: a DCP checkpoint is a folder")
    notes: list[str] = []
    if not metadata_files(folder):
        shards = _hf_shards(folder)
        if not shards:
            raise FormatError(f"{path}: no .metadata, __<rank>.metadata or shard-*.safetensors")
        tensors = _read_hf_shards(folder, shards)
        names = list(tensors)
        return SourceCheckpoint(
            format=NAME,
            path=path,
            tensors=tensors,
            hf_rules=rules_text("torchtitan_llama.rules") if _is_torchtitan(names) else "",
            config=_config(folder, config),
            topology={"files": len(shards)},
            notes=("DCP safetensors shards (HuggingFaceStorageWriter, save_distributed)",),
        )

    md = read_metadata(folder)
    _check_files(md)
    st = find_structure(md.tensors, md.planner_data)
    blobs = _safetensors_blobs(md)
    all_t = {k: _entry_tensor(e, blobs) for k, e in md.tensors.items()}
    tensors: dict[str, LazyTensor] = {}
    slots: dict[str, dict[str, LazyTensor]] = {}
    steps: dict[str, float] = {}
    skipped: list[str] = []
    state = None if st.optim is None else st.optim + "state."
    groups_prefix = None if st.optim is None else st.optim + "param_groups."
    for k, t in all_t.items():
        if state is not None and k.startswith(state):
            body = k[len(state) :]
            name, _, slot = body.rpartition(".")
            if not name:
                skipped.append(k)
            elif slot == STEP:
                if t.shape == ():
                    steps[name] = float(t.materialize())
                else:
                    skipped.append(k)
            else:
                slots.setdefault(slot, {})[name] = t
        elif groups_prefix is not None and k.startswith(groups_prefix):
            continue
        elif k.startswith(st.model):
            tensors[k[len(st.model) :]] = t
        else:
            skipped.append(k)
    if skipped:
        notes.append(
            f"skipped {len(skipped)} tensors outside the model and optimizer state: "
            f"{sorted(skipped)[:5]}"
        )
    optimizer = None
    step = None
    if slots:
        check_complete(slots, md.files[0])
        orphans = sorted(set(next(iter(slots.values()))) - set(tensors))
        if orphans:
            notes.append(f"optimizer state without a model tensor: {orphans[:5]}")
        if steps:
            values = set(steps.values())
            step = int(max(values))
            if len(values) > 1:
                notes.append(
                    f"params have different optimizer steps {sorted(values)[:5]}; using {step}"
                )
        groups = _param_groups(md, st.optim)
        hyper = torch_optim.hyper(
            groups,
            [
                [_strip(p, st.model) for p in g.get("params", []) if isinstance(p, str)]
                for g in groups
            ],
        )
        optimizer = OptimizerState(slots, step, hyper=hyper)
    if not tensors:
        raise FormatError(f"{md.files[0]}: no model tensors found (keys: {sorted(md.tensors)[:5]})")
    hf_rules = ""
    if _is_torchtitan(tensors):
        hf_rules = rules_text("torchtitan_llama.rules")
        notes.append("torchtitan Llama names: rules/torchtitan_llama.rules (wq/wk RoPE permuted)")
    if len(md.files) > 1:
        notes.append(f"rank-local metadata: {len(md.files)} __<rank>.metadata files merged")
    writers = {
        m.group(1)
        for e in md.tensors.values()
        for c in e.chunks
        if (m := re.match(r"__(\d+)_\d+\.distcp$", os.path.basename(c.path)))
    }
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=hf_rules,
        config=_config(folder, config),
        step=step,
        topology={"writers": len(writers)} if writers else {},
        trainer={
            "dcp_version": md.version,
            "written_to": md.written_to,
            "model_prefix": st.model,
            "optimizer_prefix": st.optim,
        },
        notes=tuple(notes),
    )
