"""Megatron-LM model tensors: the rank files' model chunks, renamed, numbered and TP-merged.

Model keys (NVIDIA/Megatron-LM:megatron/training/checkpointing.py `generate_state_dict`):
`model` or `model0`, `model1`, ... (one per virtual pipeline chunk), mcore flat
(`decoder.layers.{i}.self_attention.linear_qkv.weight`, ...; TE `*._extra_state` entries skipped)
or legacy nested (`language_model.encoder....`, flattened with '.', renamed to mcore names by
`rules/megatron_legacy.rules`). `layers.{i}` is the index inside the chunk: chunks are walked
(vpp outer, pp inner) and each chunk's layer count added, which gives Megatron's
`v*L/vp + p*L/(pp*vp)` offsets and also uneven stages. checkpoint_version < 2.0 stores qkv per
rank as [3, np, hn] (0) or [np, hn, 3] (1.0): converted per rank by
`rules/megatron_qkv_legacy.rules`; other versions below 2.0 are refused. TP shards merge by
`rules/megatron_tp.rules`. A tied head's copy on the last PP stage
(`word_embeddings_for_head.weight`, or mcore `output_layer.weight` when tied) is compared with
the embedding (whole when small, else on a sample of rows) and dropped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridckpt.errors import FormatError
from hybridckpt.formats.megatron import mtp
from hybridckpt.formats.megatron.experts import is_expert
from hybridckpt.formats.megatron.layout import (
    MODEL_FILE,
    RANK_DIR,
    arg,
    first_file,
    iteration_dir,
    load_state,
    rank_folder,
    topology,
)
from hybridckpt.formats.rules_files import load_rules
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import RuleSet

HEAD_COPIES = ("word_embeddings_for_head.weight",)
EMBEDDING = "embedding.word_embeddings.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_HEAD_SAMPLE_ROWS = 8
_HEAD_COMPARE_ALL_BYTES = 16 << 20  # compare a tied head copy whole up to this size


# -- flattening and renaming -----------------------------------------------------------------------


def _flatten(obj: Any, prefix: str, out: dict[str, LazyTensor], file: str) -> None:
    if isinstance(obj, LazyTensor):
        out[prefix] = obj
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise FormatError(
                    f"{file}: model key {k!r} under {prefix or 'model'!r} is not a string"
                )
            name = f"{prefix}.{k}" if prefix else k
            if name.endswith("_extra_state"):  # Transformer Engine fp8 metadata, not a weight
                continue
            _flatten(v, name, out, file)
        return
    if obj is None:
        return
    raise FormatError(f"{file}: model entry {prefix!r} is a {type(obj).__name__}, not a tensor")


class _Tag(LazyTensor):
    """A placeholder carrying a source name through a pure-rename rule set."""

    shape = ()
    dtype = np.dtype(np.uint8)

    def __init__(self, name: str):
        self.name = name

    def read_box(self, box):  # a rename placeholder is never read
        raise TypeError(f"placeholder {self.name!r} has no data")


def _rename(rules: RuleSet, names: list[str], file: str) -> dict[str, str]:
    """old name -> new name by pure-rename rules (names no rule takes stay as they are)."""
    res = rules.apply({n: _Tag(n) for n in names}, strict=False)
    out = {n: n for n in res.unconsumed}
    for new, tag in res.tensors.items():
        if not isinstance(tag, _Tag):
            raise FormatError(f"{file}: legacy rename rules must not change layouts ({new})")
        out[tag.name] = new
    return out


# -- one iteration's rank files -----------------------------------------------------------------


@dataclass
class Chunk:
    """One model chunk of one rank: params in parameters() order (mcore local names)."""

    file: str
    names: list[str]  # local mcore names, in order
    tensors: dict[str, LazyTensor]
    layers: int


class Reader:
    """One iteration of a Megatron checkpoint: its args, topology and rank files (each loaded
    once, no tensor bytes read), the rules that merge TP shards and rename legacy keys, and the
    model chunks of every (pp, tp, vpp) rank; `notes` collects remarks for `inspect`."""

    def __init__(self, path: str, config):
        self.path = path
        self.config = config
        self.it_dir = iteration_dir(path)
        first = first_file(self.it_dir)
        self.state0 = load_state(first)
        self.first_file = first
        self.args = self.state0.get("args")
        if self.args is None:
            raise FormatError(
                f"{first}: no 'args' in the checkpoint; cannot tell its parallel layout"
            )
        self.topo = topology(self.args, first)
        self.experts_per_rank = _experts_per_rank(self.args, self.topo, first)
        self.version = self.state0.get("checkpoint_version", 0)
        self.iteration = self.state0.get("iteration")
        self.swiglu = bool(arg(self.args, "swiglu", False))
        self.tp_rules = load_rules("megatron_tp.rules", tp_variables(self.args))
        self.legacy_rules = load_rules("megatron_legacy.rules")
        self.qkv_rules = self._qkv_rules()
        self.ep_files = self._files()
        self.files = {(p, r): f for (p, r, e), f in self.ep_files.items() if e == 0}
        self.ep_states = {
            k: (self.state0 if f == first else load_state(f)) for k, f in self.ep_files.items()
        }
        self.states = {(p, r): st for (p, r, e), st in self.ep_states.items() if e == 0}
        self.notes: list[str] = []

    # - files
    def _files(self) -> dict[tuple[int, int, int], str]:
        """(pp, tp, ep) rank -> its model file (every folder of the grid must exist)."""
        t = self.topo
        files, missing = {}, []
        for p in range(t.pp):
            for r in range(t.tp):
                for e in range(t.ep):
                    name = rank_folder(r, p, pp=t.pp, ep=t.ep, ep_rank=e)
                    folder = os.path.join(self.it_dir, name)
                    f = os.path.join(folder, MODEL_FILE)
                    if not os.path.isfile(f):
                        missing.append(folder if not os.path.isdir(folder) else f)
                    files[(p, r, e)] = f
        grid = f"tp={t.tp} pp={t.pp}" + (f" ep={t.ep}" if t.ep > 1 else "")
        if missing:
            raise FormatError(
                f"{self.it_dir}: args say {grid} but {', '.join(missing[:8])} "
                f"{'is' if len(missing) == 1 else 'are'} missing"
            )
        # a rank folder outside the grid means the args and the files disagree (a copy of
        # another run, a half-finished resave): refuse rather than ignore its weights
        expected = {os.path.basename(os.path.dirname(f)) for f in files.values()}
        extra = sorted(
            n for n in os.listdir(self.it_dir) if RANK_DIR.match(n) and n not in expected
        )
        if extra:
            raise FormatError(
                f"{self.it_dir}: args say {grid} but rank folder(s) "
                f"{', '.join(extra[:8])} lie outside that grid"
            )
        return files

    def _qkv_rules(self) -> RuleSet | None:
        v = self.version
        if isinstance(v, (int, float)) and v >= 2.0:
            return None
        if v not in (0, 1.0):
            raise FormatError(
                f"{self.first_file}: checkpoint_version {v!r} cannot be converted (known: 0, 1.0, >= 2.0)"
            )
        a = self.args
        heads, groups = arg(a, "num_attention_heads"), arg(a, "num_query_groups")
        if arg(a, "group_query_attention") and groups not in (None, heads):
            raise FormatError(
                f"{self.first_file}: checkpoint_version {v} with grouped-query attention cannot be converted"
            )
        if not isinstance(heads, int) or heads % self.topo.tp:
            raise FormatError(
                f"{self.first_file}: args.num_attention_heads {heads!r} does not divide by tp {self.topo.tp}"
            )
        hn = arg(a, "kv_channels") or arg(a, "hidden_size") // heads
        variables = {"heads_local": heads // self.topo.tp, "head_dim": hn, "qkv_v0": v == 0}
        return load_rules("megatron_qkv_legacy.rules", variables)

    # - model chunks
    def chunk(self, p: int, r: int, v: int, e: int = 0) -> Chunk:
        f, st = self.ep_files[(p, r, e)], self.ep_states[(p, r, e)]
        key = "model" if self.topo.vpp == 1 else f"model{v}"
        if key not in st:
            raise FormatError(
                f"{f}: key {key!r} missing (args say virtual pipeline size {self.topo.vpp})"
            )
        flat: dict[str, LazyTensor] = {}
        _flatten(st[key], "", flat, f)
        renamed = _rename(self.legacy_rules, list(flat), f)
        names = [renamed[n] for n in flat]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise FormatError(f"{f}: {key} holds {dup} under both legacy and current names")
        tensors = {renamed[n]: t for n, t in flat.items()}
        if self.qkv_rules is not None:
            tensors = self.fix_qkv(tensors, f)
        idx = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
        if idx != list(range(len(idx))):
            raise FormatError(f"{f}: {key} has layers {idx}, expected 0..{len(idx) - 1}")
        return Chunk(f, names, tensors, len(idx))

    def fix_qkv(self, tensors: dict[str, LazyTensor], f: str) -> dict[str, LazyTensor]:
        """`tensors` with checkpoint_version < 2.0 qkv converted per rank."""
        res = self.qkv_rules.apply(tensors, strict=False)
        out = dict(tensors)
        out.update(res.tensors)
        return out

    def chunks(self) -> dict[tuple[int, int, int], Chunk]:
        """The model chunks of expert-parallel rank 0, by (pp, tp, vpp)."""
        t = self.topo
        return {
            (p, r, v): self.chunk(p, r, v)
            for p in range(t.pp)
            for r in range(t.tp)
            for v in range(t.vpp)
        }

    def expert_chunks(self) -> dict[tuple[int, int, int, int], Chunk]:
        """The model chunks of the other expert-parallel ranks, by (pp, tp, vpp, ep): each holds
        its own experts and a copy of everything else, whose names must be ep rank 0's."""
        t, out = self.topo, {}
        for p in range(t.pp):
            for r in range(t.tp):
                for v in range(t.vpp):
                    dense0 = None
                    for e in range(1, t.ep):
                        ch = self.chunk(p, r, v, e)
                        dense0 = dense0 or [
                            n for n in self.chunk(p, r, v).names if not is_expert(n)
                        ]
                        dense = [n for n in ch.names if not is_expert(n)]
                        if dense != dense0:
                            diff = sorted(set(dense) ^ set(dense0))[:3]
                            raise FormatError(
                                f"{ch.file}: its non-expert parameters differ from expert-parallel "
                                f"rank 0's ({diff})"
                            )
                        out[(p, r, v, e)] = ch
        return out

    def offsets(self, chunks) -> dict[tuple[int, int], int]:
        """Global number of each chunk's layer 0: walk (vpp outer, pp inner)."""
        t = self.topo
        out, pos = {}, 0
        for v in range(t.vpp):
            for p in range(t.pp):
                counts = {r: chunks[(p, r, v)].layers for r in range(t.tp)}
                if len(set(counts.values())) != 1:
                    r = next(r for r, c in counts.items() if c != counts[0])
                    raise FormatError(
                        f"{chunks[(p, r, v)].file}: holds {counts[r]} layers in chunk {v} but "
                        f"{chunks[(p, 0, v)].file} holds {counts[0]}"
                    )
                out[(p, v)] = pos
                pos += counts[0]
        return out


def tp_variables(args) -> dict[str, bool]:
    """The variables of `rules/megatron_tp.rules`: SwiGLU fc1 halves, and MLA's down
    projections whole on every rank with Transformer Engine (`duplicated`)."""
    return {
        "swiglu": bool(arg(args, "swiglu", False)),
        "te_down_proj": arg(args, "transformer_impl", "transformer_engine") != "local",
    }


def _experts_per_rank(args, topo, file: str) -> int:
    """Routed experts per expert-parallel rank (0 for a dense model); expert tensor parallelism
    other than the dense TP is refused (its shards would not line up with the tp folders)."""
    num = arg(args, "num_experts")
    if not num:
        if topo.ep > 1:
            raise FormatError(
                f"{file}: args.expert_model_parallel_size={topo.ep} without num_experts"
            )
        return 0
    return checked_experts(args, topo, file, "only experts split like the dense layers are read") // topo.ep


def checked_experts(args, topo, where: str, otherwise: str) -> int:
    """`args.num_experts` (set) when it divides over the expert-parallel ranks and the experts'
    tensor parallelism is the dense layers'; else a FormatError naming `where` and saying
    `otherwise` (what is read instead)."""
    num = arg(args, "num_experts")
    if not isinstance(num, int) or num % topo.ep:
        raise FormatError(
            f"{where}: args.num_experts={num!r} does not divide over expert_model_parallel_size={topo.ep}"
        )
    etp = arg(args, "expert_tensor_parallel_size")
    if etp not in (None, topo.tp):
        raise FormatError(
            f"{where}: args.expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size="
            f"{topo.tp}; {otherwise}"
        )
    return num


def global_name(name: str, offset: int, num_layers: int = 0) -> str:
    """`name` with its chunk-local layer number moved by `offset` (the chunk's first layer); an
    MTP layer's (last stage, `mtp.layers.{i}.*`) numbered after the `num_layers` decoder layers
    (`mtp.global_name`)."""
    if name.startswith("mtp.layers."):
        return mtp.global_name(name, num_layers) or name
    m = _LAYER.match(name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) + offset}." + name[m.end() :]


def merge_tp(
    per_rank: Mapping[tuple[int, int], Mapping[str, LazyTensor]],
    files: Mapping[tuple[int, int], str],
    rules: RuleSet,
    tp: int,
    what: str = "",
) -> dict[str, LazyTensor]:
    """Join TP shards of every global name (which must be on all tp ranks of one pp stage)."""
    owner: dict[str, int] = {}
    for (p, r), tensors in per_rank.items():
        for n in tensors:
            if owner.setdefault(n, p) != p:
                raise FormatError(
                    f"{what}{n!r} is in both {files[(owner[n], 0)]} and {files[(p, r)]}"
                )
    out = {}
    for n, p in owner.items():
        shards = []
        for r in range(tp):
            t = per_rank[(p, r)].get(n)
            if t is None:
                raise FormatError(
                    f"{files[(p, r)]}: {what}key {n!r} is missing (rank 0 of this stage has it)"
                )
            if shards and t.shape != shards[0].shape:
                raise FormatError(
                    f"{files[(p, r)]}: {what}key {n!r} has shape {t.shape}, expected {shards[0].shape} "
                    f"as in {files[(p, 0)]}"
                )
            if shards and np.dtype(t.dtype) != np.dtype(shards[0].dtype):
                raise FormatError(
                    f"{files[(p, r)]}: {what}key {n!r} is {t.dtype}, expected {shards[0].dtype}"
                )
            shards.append(t)
        out[n] = rules.merge_tp(n, shards)
    return out


def check_head_copy(emb: LazyTensor, head: LazyTensor, name: str, where: str) -> None:
    """The tied head's copy must equal the embedding: all of it when small, else sampled rows."""
    if head.shape != emb.shape:
        raise FormatError(
            f"{where}: tied {name} has shape {head.shape} but the embedding has {emb.shape}"
        )
    n = emb.shape[0]
    if emb.nbytes <= _HEAD_COMPARE_ALL_BYTES:
        blocks = [(0, n)]
    else:
        blocks = [(int(i), int(i) + 1) for i in np.linspace(0, n - 1, _HEAD_SAMPLE_ROWS)]
    for a, b in sorted(set(blocks)):
        x = emb.read(np.s_[a:b]).view(np.uint8).reshape(b - a, -1)
        y = head.read(np.s_[a:b]).view(np.uint8).reshape(b - a, -1)
        if not np.array_equal(x, y):
            row = a + int(np.flatnonzero((x != y).any(axis=1))[0])
            raise FormatError(
                f"{where}: args say the output layer is tied to the embedding but {name} row {row} "
                f"differs from {EMBEDDING} row {row}"
            )
