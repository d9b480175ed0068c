"""Megatron-LM legacy (torch format) checkpoints: `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt`.

Layout (NVIDIA/Megatron-LM:megatron/training/checkpointing.py `get_checkpoint_name`,
`read_metadata`, `generate_state_dict`):
- `<save>/latest_checkpointed_iteration.txt`: an integer or `release`; the folder is
  `iter_{N:07d}` or `release`. `path` may be the save folder or the iteration folder.
- One folder per model-parallel rank: `mp_rank_{tp:02d}` (PP = 1) or
  `mp_rank_{tp:02d}_{pp:03d}`, `_{ep:03d}` appended when EP > 1 (so `mp_rank_00_001` is read
  with `args`). Every folder of the tp x pp grid must exist (DP rank 0 writes them).
- `model_optim_rng.pt`: `args` (argparse.Namespace), `checkpoint_version` (absent = 0),
  `iteration`, `model` or `model0`, `model1`, ... (one per virtual pipeline chunk),
  `optimizer`, `opt_param_scheduler`, `rng_state`, ...; `distrib_optim.pt` beside it with
  `--use-distributed-optimizer` (see `megatron_optim`).
- Model keys: mcore flat (`decoder.layers.{i}.self_attention.linear_qkv.weight`, ...; TE
  `*._extra_state` entries skipped) or legacy nested (`language_model.encoder....`, flattened
  with '.', renamed to mcore names by `rules/megatron_legacy.rules`). `layers.{i}` is the index
  inside the chunk: chunks are walked (vpp outer, pp inner) and each chunk's layer count added,
  which gives Megatron's `v*L/vp + p*L/(pp*vp)` offsets and also uneven stages.
- checkpoint_version < 2.0 stores qkv per rank as [3, np, hn] (0) or [np, hn, 3] (1.0):
  converted per rank by `rules/megatron_qkv_legacy.rules`; other versions below 2.0 are refused.
- TP shards merge by `rules/megatron_tp.rules`. A tied head's copy on the last PP stage
  (`word_embeddings_for_head.weight`, or mcore `output_layer.weight` when tied) is compared with
  the embedding on a sample of rows and dropped.

The tensors returned are mcore-named, global (layers numbered 0..L-1, TP merged, padded vocab);
`hf_rules` (`rules/megatron_llama.rules` or `megatron_gpt2.rules`) maps them to HF names.
Optimizer state: distributed optimizer buffers or the torch optimizer state, merged the same
way, as slots under torch's names (`megatron_optim`).
"""

from __future__ import annotations

import builtins
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.megatron import optimizer as optim
from hybridckpt.formats.rules_files import load_rules, rules_text
from hybridckpt.io.pickle import torch_save
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import RuleSet
from hybridckpt.source import OptimizerState, SourceCheckpoint

NAME = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
HEAD_COPIES = ("word_embeddings_for_head.weight",)
EMBEDDING = "embedding.word_embeddings.weight"
_RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_HEAD_SAMPLE_ROWS = 8
_HEAD_COMPARE_ALL_BYTES = 16 << 20  # compare a tied head copy whole up to this size


# -- discovery -------------------------------------------------------------------------------


def _has_rank_dirs(folder: str) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(
        _RANK_DIR.match(n) and os.path.isfile(os.path.join(folder, n, MODEL_FILE)) for n in names
    )


def detect(path: str) -> bool:
    """A save folder whose tracker names a folder of `mp_rank_*` dirs, or such a folder itself
    (Megatron's `torch_dist` format has the tracker too, but `.distcp` files: not ours)."""
    if not os.path.isdir(path):
        return False
    try:
        return _has_rank_dirs(iteration_dir(path))
    except FormatError:
        return False


def iteration_dir(path: str) -> str:
    """The `iter_N` / `release` folder of `path` (a save folder or the iteration folder)."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with builtins.open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        if text == "release":
            folder = "release"
        else:
            try:
                folder = f"iter_{int(text):07d}"
            except ValueError:
                raise FormatError(
                    f"{tracker}: expected an iteration number or 'release', found {text!r}"
                ) from None
        it_dir = os.path.join(path, folder)
        if not os.path.isdir(it_dir):
            raise FormatError(f"{tracker} names {text!r} but the folder {it_dir} is missing")
        return it_dir
    if _has_rank_dirs(path):
        return path
    raise FormatError(f"{path}: no {TRACKER} and no mp_rank_* folders: not a Megatron checkpoint")


def _arg(args: Any, name: str, default=None):
    return getattr(args, name, default) if args is not None else default


def rank_folder(tp_rank: int, pp_rank: int, *, pp: int, ep: int = 1, ep_rank: int = 0) -> str:
    """Megatron's rank folder name (checkpointing.py `get_checkpoint_name`)."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep > 1 else "")


def _first_file(it_dir: str) -> str:
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        f = os.path.join(it_dir, name, MODEL_FILE)
        if os.path.isfile(f):
            return f
    raise FormatError(
        f"{it_dir}: the tensor/pipeline rank 0 folder (mp_rank_00 or mp_rank_00_000) is missing"
    )


def _load(path: str) -> Mapping:
    state = torch_save.load(path)
    if not isinstance(state, Mapping):
        raise FormatError(f"{path}: expected a dict, found {type(state).__name__}")
    return state


# -- per-rank model tensors ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Topology:
    tp: int
    pp: int
    vpp: int
    ep: int
    dp: int


def _topology(args, file: str) -> _Topology:
    def deg(name, default=1):
        v = _arg(args, name, default)
        v = default if v is None else v
        if not isinstance(v, int) or v < 1:
            raise FormatError(f"{file}: args.{name} should be a positive int, found {v!r}")
        return v

    tp, pp = deg("tensor_model_parallel_size"), deg("pipeline_model_parallel_size")
    world = _arg(args, "world_size")
    dp = _arg(args, "data_parallel_size")
    if dp is None and isinstance(world, int) and world >= tp * pp:
        dp = world // (tp * pp)
    return _Topology(
        tp=tp,
        pp=pp,
        vpp=deg("virtual_pipeline_model_parallel_size"),
        ep=deg("expert_model_parallel_size"),
        dp=dp if isinstance(dp, int) and dp >= 1 else 1,
    )


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


# -- the importer ----------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """One model chunk of one rank: params in parameters() order (mcore local names)."""

    file: str
    names: list[str]  # local mcore names, in order
    tensors: dict[str, LazyTensor]
    layers: int


class _Reader:
    def __init__(self, path: str, config):
        self.path = path
        self.config = config
        self.it_dir = iteration_dir(path)
        first = _first_file(self.it_dir)
        self.state0 = _load(first)
        self.first_file = first
        self.args = self.state0.get("args")
        if self.args is None:
            raise FormatError(
                f"{first}: no 'args' in the checkpoint; cannot tell its parallel layout"
            )
        self.topo = _topology(self.args, first)
        if self.topo.ep > 1 or _arg(self.args, "num_experts"):
            raise FormatError(
                f"{first}: mixture-of-experts checkpoints (num_experts, expert parallel) are not supported"
            )
        self.version = self.state0.get("checkpoint_version", 0)
        self.iteration = self.state0.get("iteration")
        self.swiglu = bool(_arg(self.args, "swiglu", False))
        self.tp_rules = load_rules("megatron_tp.rules", {"swiglu": self.swiglu})
        self.legacy_rules = load_rules("megatron_legacy.rules")
        self.qkv_rules = self._qkv_rules()
        self.files = self._files()
        self.states = {k: (self.state0 if f == first else _load(f)) for k, f in self.files.items()}
        self.notes: list[str] = []

    # - files
    def _files(self) -> dict[tuple[int, int], str]:
        t = self.topo
        files, missing = {}, []
        for p in range(t.pp):
            for r in range(t.tp):
                folder = os.path.join(self.it_dir, rank_folder(r, p, pp=t.pp, ep=t.ep))
                f = os.path.join(folder, MODEL_FILE)
                if not os.path.isfile(f):
                    missing.append(folder if not os.path.isdir(folder) else f)
                files[(p, r)] = f
        if missing:
            raise FormatError(
                f"{self.it_dir}: args say tp={t.tp} pp={t.pp} but {', '.join(missing[:8])} "
                f"{'is' if len(missing) == 1 else 'are'} missing"
            )
        # a rank folder outside the grid means the args and the files disagree (a copy of
        # another run, a half-finished resave): refuse rather than ignore its weights
        expected = {os.path.basename(os.path.dirname(f)) for f in files.values()}
        extra = sorted(n for n in os.listdir(self.it_dir) if _RANK_DIR.match(n) and n not in expected)
        if extra:
            raise FormatError(
                f"{self.it_dir}: args say tp={t.tp} pp={t.pp} but rank folder(s) "
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
        heads, groups = _arg(a, "num_attention_heads"), _arg(a, "num_query_groups")
        if _arg(a, "group_query_attention") and groups not in (None, heads):
            raise FormatError(
                f"{self.first_file}: checkpoint_version {v} with grouped-query attention cannot be converted"
            )
        if not isinstance(heads, int) or heads % self.topo.tp:
            raise FormatError(
                f"{self.first_file}: args.num_attention_heads {heads!r} does not divide by tp {self.topo.tp}"
            )
        hn = _arg(a, "kv_channels") or _arg(a, "hidden_size") // heads
        variables = {"heads_local": heads // self.topo.tp, "head_dim": hn, "qkv_v0": v == 0}
        return load_rules("megatron_qkv_legacy.rules", variables)

    # - model chunks
    def chunk(self, p: int, r: int, v: int) -> _Chunk:
        f, st = self.files[(p, r)], self.states[(p, r)]
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
            tensors = self._fix_qkv(tensors, f)
        idx = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
        if idx != list(range(len(idx))):
            raise FormatError(f"{f}: {key} has layers {idx}, expected 0..{len(idx) - 1}")
        return _Chunk(f, names, tensors, len(idx))

    def _fix_qkv(self, tensors: dict[str, LazyTensor], f: str) -> dict[str, LazyTensor]:
        res = self.qkv_rules.apply(tensors, strict=False)
        out = dict(tensors)
        out.update(res.tensors)
        return out

    def chunks(self) -> dict[tuple[int, int, int], _Chunk]:
        t = self.topo
        return {
            (p, r, v): self.chunk(p, r, v)
            for p in range(t.pp)
            for r in range(t.tp)
            for v in range(t.vpp)
        }

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


def _global(name: str, offset: int) -> str:
    m = _LAYER.match(name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) + offset}." + name[m.end() :]


def _merge(
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


def _check_head_copy(emb: LazyTensor, head: LazyTensor, name: str, where: str) -> None:
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


# -- model config ---------------------------------------------------------------------------------


def _family(args, file: str) -> str:
    norm = _arg(args, "normalization", "LayerNorm")
    pos = _arg(args, "position_embedding_type")
    if pos is None:
        pos = "rope" if _arg(args, "use_rotary_position_embeddings") else "learned_absolute"
    swiglu = bool(_arg(args, "swiglu", False))
    if _arg(args, "rotary_interleaved"):
        raise FormatError(
            f"{file}: args.rotary_interleaved=True (Meta-style RoPE pairs) is not supported"
        )
    if pos == "rope" and (_arg(args, "rotary_percent", 1.0) or 1.0) != 1.0:
        raise FormatError(
            f"{file}: args.rotary_percent={_arg(args, 'rotary_percent')} (partial RoPE) is not supported"
        )
    if _arg(args, "apply_layernorm_1p"):
        raise FormatError(
            f"{file}: args.apply_layernorm_1p=True (norm weights stored minus 1) is not supported"
        )
    if swiglu and norm == "RMSNorm" and pos == "rope":
        return "llama"
    if not swiglu and norm == "LayerNorm" and pos == "learned_absolute":
        return "gpt2"
    raise FormatError(
        f"{file}: args describe normalization={norm}, swiglu={swiglu}, position_embedding_type={pos}: "
        f"neither Llama (RMSNorm, SwiGLU, rope) nor GPT-2 (LayerNorm, GELU, learned_absolute)"
    )


def _true_vocab(args, config, file: str) -> int:
    padded = _arg(args, "padded_vocab_size")
    own = _arg(args, "vocab_size")
    given = getattr(config, "vocab_size", None) if config is not None else None
    if isinstance(own, int) and isinstance(given, int) and own != given:
        raise ConfigError(f"{file}: args.vocab_size is {own} but the given config says {given}")
    vocab = own if isinstance(own, int) else given
    if vocab is None:
        raise FormatError(
            f"{file}: args.vocab_size is not set and the embedding holds padded_vocab_size={padded} "
            f"rows including Megatron's vocab padding; pass --config (the model's HF config.json) "
            f"to give the true vocabulary size"
        )
    if isinstance(padded, int) and vocab > padded:
        raise ConfigError(
            f"{file}: vocab_size {vocab} exceeds the checkpoint's padded_vocab_size {padded}"
        )
    return vocab


def model_config(args, config, file: str):
    """A models.LlamaConfig / GPT2Config from `args` (true vocab from args or `config`)."""
    import models

    family = _family(args, file)
    vocab = _true_vocab(args, config, file)
    a = args
    hidden, heads, layers = (
        _arg(a, "hidden_size"),
        _arg(a, "num_attention_heads"),
        _arg(a, "num_layers"),
    )
    eps = _arg(a, "norm_epsilon", None) or _arg(a, "layernorm_epsilon", 1e-5)
    max_pos = _arg(a, "max_position_embeddings") or _arg(a, "seq_length") or 2048
    if family == "llama":
        groups = _arg(a, "num_query_groups") if _arg(a, "group_query_attention") else heads
        cfg = models.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_arg(a, "ffn_hidden_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=groups or heads,
            head_dim=_arg(a, "kv_channels") or hidden // heads,
            rms_norm_eps=float(eps),
            rope_theta=float(_arg(a, "rotary_base", 10000) or 10000),
            tie_word_embeddings=not _arg(a, "untie_embeddings_and_output_weights", False),
            max_position_embeddings=max_pos,
        )
    else:
        cfg = models.GPT2Config(
            vocab_size=vocab,
            n_positions=max_pos,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=_arg(a, "ffn_hidden_size") or 4 * hidden,
            layer_norm_epsilon=float(eps),
        )
    if config is not None:
        _check_config(cfg, config, file)
    return cfg


def _check_config(cfg, given, file: str) -> None:
    if type(given) is not type(cfg):
        raise ConfigError(
            f"{file}: args describe a {type(cfg).__name__} but the given config is a {type(given).__name__}"
        )
    for f in (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "n_embd",
        "n_layer",
        "n_head",
    ):
        if hasattr(cfg, f) and getattr(cfg, f) != getattr(given, f):
            raise ConfigError(
                f"{file}: args give {f}={getattr(cfg, f)} but the given config says {getattr(given, f)}"
            )


# -- optimizer --------------------------------------------------------------------------------------


def _bucket_sizes(args, p: int, v: int) -> list[int | None]:
    """Bucket sizes to try for model chunk v on pp rank p (distributed_data_parallel.py)."""
    sizes: list[int | None] = [None]
    if _arg(args, "overlap_grad_reduce") and p == 0 and v == 0:
        bs = _arg(args, "ddp_bucket_size")
        dp = _arg(args, "data_parallel_size", 1) or 1
        sizes.insert(0, bs if bs else max(40_000_000, 1_000_000 * dp))
    return sizes


def _specs(chunk: _Chunk, shared_names: set[str]) -> list[optim.ParamSpec]:
    return [
        optim.ParamSpec(n, tuple(chunk.tensors[n].shape), n in shared_names) for n in chunk.names
    ]


# -- open -------------------------------------------------------------------------------------------


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """Plan the import of a Megatron torch-format checkpoint (reads pickles, no tensor bytes
    except a few rows of a tied head's copy)."""
    rd = _Reader(path, config)
    t, args = rd.topo, rd.args
    cfg = model_config(args, config, rd.first_file)
    tied = not _arg(args, "untie_embeddings_and_output_weights", False)
    chunks = rd.chunks()
    offsets = rd.offsets(chunks)

    per_rank: dict[tuple[int, int], dict[str, LazyTensor]] = {
        (p, r): {} for p in range(t.pp) for r in range(t.tp)
    }
    for (p, r, v), ch in chunks.items():
        for n in ch.names:
            per_rank[(p, r)][_global(n, offsets[(p, v)])] = ch.tensors[n]
    tensors = _merge(per_rank, rd.files, rd.tp_rules, t.tp)

    head_copies = [n for n in HEAD_COPIES if n in tensors]
    if tied and "output_layer.weight" in tensors:
        head_copies.append("output_layer.weight")
    for n in head_copies:
        if EMBEDDING not in tensors:
            raise FormatError(f"{rd.it_dir}: {n} is present but {EMBEDDING} is not")
        _check_head_copy(tensors[EMBEDDING], tensors[n], n, rd.it_dir)
        del tensors[n]
    if head_copies:
        rd.notes.append(f"dropped {', '.join(head_copies)}: the tied head's copy of the embedding")

    optimizer = _optimizer(rd, chunks, offsets, set(head_copies), tied)
    family = "llama" if cfg.family == "llama" else "gpt2"
    padded = _arg(args, "padded_vocab_size") or tensors[EMBEDDING].shape[0]
    rule_vars = {
        "vocab_size": cfg.vocab_size,
        "padded_vocab": padded,
        "num_heads": _arg(args, "num_attention_heads"),
        "num_kv_heads": cfg.num_kv_heads if family == "llama" else cfg.n_head,
        "hidden_size": _arg(args, "hidden_size"),
        "head_dim": cfg.head_dim,
        "swiglu": rd.swiglu,
        "tied": tied,
        "te_norms": any(n.endswith(".linear_qkv.layer_norm_weight") for n in tensors),
    }
    if family == "gpt2" and not _arg(args, "openai_gelu", False):
        rd.notes.append(
            "Megatron's GELU is erf-based (F.gelu); GPT2LMHeadModel uses gelu_new (tanh approximation)"
        )
    if family == "gpt2" and not tied:
        rd.notes.append(
            "untied output layer: GPT2LMHeadModel ties lm_head to wte and ignores lm_head.weight"
        )
    step = rd.iteration if isinstance(rd.iteration, int) else None
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=rules_text(f"megatron_{family}.rules"),
        rule_vars=rule_vars,
        config=cfg,
        step=step,
        topology={"tp": t.tp, "pp": t.pp, "vpp": t.vpp, "dp": t.dp},
        trainer=_trainer(rd),
        notes=tuple(rd.notes),
    )


def _optimizer(
    rd: _Reader, chunks, offsets, head_copies: set[str], tied: bool
) -> OptimizerState | None:
    t, args = rd.topo, rd.args
    if "optimizer" not in rd.state0:
        rd.notes.append("no optimizer state (saved with --no-save-optim)")
        return None
    shared = set()
    if tied and t.pp > 1:  # megatron/core/models/common/language_module/language_module.py
        shared = {EMBEDDING, "output_layer.weight", *HEAD_COPIES}
    kinds: dict[str, dict[tuple[int, int], dict[str, LazyTensor]]] = {}  # master and slots
    for p in range(t.pp):
        for r in range(t.tp):
            f = rd.files[(p, r)]
            specs = [
                _specs(
                    chunks[(p, r, v)],
                    shared if (p, v) in ((0, 0), (t.pp - 1, t.vpp - 1)) else set(),
                )
                for v in range(t.vpp)
            ]
            opt = rd.states[(p, r)].get("optimizer")
            dist_file = os.path.join(os.path.dirname(f), OPTIM_FILE)
            if _arg(args, "use_distributed_optimizer") or os.path.isfile(dist_file):
                if not os.path.isfile(dist_file):
                    raise FormatError(
                        f"{dist_file}: missing (args.use_distributed_optimizer is set)"
                    )
                decoded = optim.decode_distributed(
                    torch_save.load(dist_file),
                    specs,
                    [_bucket_sizes(args, p, v) for v in range(t.vpp)],
                    file=dist_file,
                )
            else:
                flat = optim.decode_torch_state(opt, [s for ch in specs for s in ch], file=f)
                if flat is None:
                    rd.notes.append(f"{f}: optimizer holds no per-parameter state")
                    return None
                decoded, i = [], 0
                for ch in specs:
                    decoded.append(flat[i : i + len(ch)])
                    i += len(ch)
            for v, ch in enumerate(specs):
                for spec, views in zip(ch, decoded[v], strict=True):
                    g = _global(spec.name, offsets[(p, v)])
                    for kind, view in views.items():
                        kinds.setdefault(kind, {}).setdefault((p, r), {})[g] = view
    merged = {}
    for kind, per_rank in kinds.items():
        if not per_rank:
            continue
        if rd.qkv_rules is not None:
            per_rank = {k: rd._fix_qkv(dict(v), rd.files[k]) for k, v in per_rank.items()}
        m = _merge(per_rank, rd.files, rd.tp_rules, t.tp, what=f"optimizer {kind} ")
        for n in head_copies:
            m.pop(n, None)
        merged[kind] = m
    groups = optim.param_groups(rd.state0["optimizer"], rd.first_file)
    hyper = {}
    if groups:
        g0 = groups[0]
        for k in ("lr", "eps", "weight_decay"):
            if isinstance(g0.get(k), (int, float)):
                hyper[k] = float(g0[k])
        betas = g0.get("betas")
        if isinstance(betas, (tuple, list)) and all(isinstance(b, (int, float)) for b in betas):
            hyper["betas"] = [float(b) for b in betas]
    return OptimizerState(
        slots={k: v for k, v in merged.items() if k != optim.MASTER},
        step=rd.iteration if isinstance(rd.iteration, int) else None,
        master=merged.get(optim.MASTER, {}),
        hyper=hyper,
    )


def _plain(x: Any, depth: int = 0):
    """A JSON-serialisable copy of simple values (numbers, strings, small dicts/lists)."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x if not (isinstance(x, float) and not math.isfinite(x)) else str(x)
    if isinstance(x, np.generic):
        return x.item()
    if depth < 3 and isinstance(x, Mapping):
        out = {str(k): _plain(v, depth + 1) for k, v in x.items()}
        return {k: v for k, v in out.items() if v is not _SKIP}
    if depth < 3 and isinstance(x, (list, tuple)) and len(x) <= 16:
        out = [_plain(v, depth + 1) for v in x]
        return out if _SKIP not in out else _SKIP
    return _SKIP


_SKIP = object()


def _trainer(rd: _Reader) -> dict:
    st, args = rd.state0, rd.args
    out: dict[str, Any] = {"iteration": rd.iteration, "checkpoint_version": rd.version}
    for k in (
        "consumed_train_samples",
        "consumed_valid_samples",
        "seed",
        "seq_length",
        "global_batch_size",
    ):
        v = _plain(_arg(args, k))
        if v is not None and v is not _SKIP:
            out[k] = v
    for k in ("num_floating_point_operations_so_far",):
        v = _plain(st.get(k))
        if v is not None and v is not _SKIP:
            out[k] = v
    sched = st.get("opt_param_scheduler", st.get("lr_scheduler"))
    if isinstance(sched, Mapping):
        out["opt_param_scheduler"] = _plain(sched)
    return out
