"""`open`: a Megatron-LM torch-format checkpoint as lazy global tensors, slots and metadata.

Reads the rank files (`layout`), their model chunks (`model`), the model config the args describe
and the rules to HF names of its family's megatron dialect (`config`), and the optimizer state of every rank
(`optimizer`: distributed optimizer buffers or the torch optimizer state), merged across tensor
and pipeline ranks the same way as the weights, as slots under torch's names. The tensors
returned are mcore-named, global (layers numbered 0..L-1, TP merged, padded vocab); `hf_rules`
maps them to HF names. Trainer metadata: iteration, checkpoint_version, consumed samples, seed,
the LR scheduler state.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt import models
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats.megatron import mtp
from hybridckpt.formats.megatron import optimizer as optim
from hybridckpt.formats.megatron.config import family_architecture, model_config, notes_for
from hybridckpt.formats.megatron.experts import (
    check_complete,
    globalize,
    is_buffer,
    is_expert,
    zero_buffer_state,
)
from hybridckpt.formats.megatron.layout import OPTIM_FILE, arg
from hybridckpt.formats.megatron.model import (
    EMBEDDING,
    HEAD_COPIES,
    Chunk,
    Reader,
    check_head_copy,
    global_name,
    merge_tp,
)
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim.groups import check_group
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "megatron"


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """Plan the import of a Megatron torch-format checkpoint (reads pickles, no tensor bytes
    except a few rows of a tied head's copy)."""
    rd, tensors, optimizer = read_global(path, config)
    t, args = rd.topo, rd.args
    cfg = model_config(args, config, rd.first_file)
    arch = family_architecture(cfg, rd.first_file)
    padded = arg(args, "padded_vocab_size") or tensors[EMBEDDING].shape[0]
    rule_vars = {
        **models.rule_variables(cfg),
        "padded_vocab": padded,
        "swiglu": rd.swiglu,
        "tied": _tied(args),
        "te_norms": any(n.endswith(".linear_qkv.layer_norm_weight") for n in tensors),
    }
    facts = {**rule_vars, "openai_gelu": bool(arg(args, "openai_gelu", False))}
    rd.notes.extend(notes_for(arch, facts))
    step = rd.iteration if isinstance(rd.iteration, int) else None
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=optimizer,
        hf_rules=arch.dialect.rules_text(),
        rule_vars=rule_vars,
        config=cfg,
        step=step,
        topology={"tp": t.tp, "pp": t.pp, "vpp": t.vpp, "dp": t.dp}
        | ({"ep": t.ep} if rd.experts_per_rank else {}),
        trainer=_trainer(rd),
        notes=tuple(rd.notes),
    )


def _tied(args) -> bool:
    return not arg(args, "untie_embeddings_and_output_weights", False)


def read_global(
    path: str, config=None
) -> tuple[Reader, dict[str, LazyTensor], OptimizerState | None]:
    """(the Reader, the mcore-named global tensors, the optimizer state): every rank file's
    chunks numbered globally, local experts under their global index (`experts`), TP merged, a
    tied head's copy checked and dropped. Needs no model family (the HF names come after)."""
    rd = Reader(path, config)
    t, tied = rd.topo, _tied(rd.args)
    chunks = rd.chunks()
    offsets = rd.offsets(chunks)
    all_chunks = {(p, r, v, 0): ch for (p, r, v), ch in chunks.items()}
    all_chunks.update(rd.expert_chunks() if t.ep > 1 else {})

    per_rank: dict[tuple[int, int], dict[str, LazyTensor]] = {
        (p, r): {} for p in range(t.pp) for r in range(t.tp)
    }
    for (p, r, v, e), ch in all_chunks.items():
        named = {
            _global(rd, n, p, v, offsets): ch.tensors[n]
            for n in ch.names
            if e == 0 or is_expert(n)  # other ep ranks: their experts; the rest is a replica
        }
        _add(per_rank[(p, r)], _globalize(rd, named, e, ch.file), ch.file)
    tensors = merge_tp(per_rank, rd.files, rd.tp_rules, t.tp)
    if rd.experts_per_rank:
        check_complete(tensors, rd.experts_per_rank * t.ep, rd.it_dir)

    head_copies = [n for n in (*HEAD_COPIES, mtp.EMBEDDING_COPY) if n in tensors]
    if tied and "output_layer.weight" in tensors:
        head_copies.append("output_layer.weight")
    for n in head_copies:
        if EMBEDDING not in tensors:
            raise FormatError(f"{rd.it_dir}: {n} is present but {EMBEDDING} is not")
        check_head_copy(tensors[EMBEDDING], tensors[n], n, rd.it_dir)
        del tensors[n]
    if head_copies:
        what = "the MTP stage's" if head_copies == [mtp.EMBEDDING_COPY] else "the tied head's"
        rd.notes.append(f"dropped {', '.join(head_copies)}: {what} copy of the embedding")
    optimizer = _optimizer(rd, all_chunks, offsets, set(head_copies), tied)
    if mtp_layers := mtp.layer_indices(tensors):  # the shared embedding / head, per MTP layer
        added = mtp.add_shared(tensors, mtp_layers, tied)
        for slot in optimizer.slots.values() if optimizer is not None else ():
            mtp.add_shared(slot, mtp_layers, tied)
        if optimizer is not None and optimizer.master:
            mtp.add_shared(optimizer.master, mtp_layers, tied)
        rd.notes.append(f"{', '.join(added)}: the MTP layers' shared embedding / output layer")
    if optimizer is not None and (buffers := zero_buffer_state(tensors, optimizer.slots)):
        rd.notes.append(
            f"{buffers[0]} (and {len(buffers) - 1} more): the router's expert_bias buffers, "
            f"no optimizer state: given zero moments"
        )
    return rd, tensors, optimizer


def _global(rd: Reader, name: str, p: int, v: int, offsets) -> str:
    """The global name of chunk (p, v)'s `name`; the MTP stage's own embedding copy (pp > 1) under
    `mtp.EMBEDDING_COPY`, checked against the embedding and dropped like a tied head's copy."""
    t = rd.topo
    if name == EMBEDDING and (p, v) == (t.pp - 1, t.vpp - 1) != (0, 0) and mtp.runs_mtp(rd.args):
        return mtp.EMBEDDING_COPY
    return global_name(name, offsets[(p, v)], arg(rd.args, "num_layers", 0))


def _globalize(
    rd: Reader, named: dict[str, LazyTensor], e: int, file: str
) -> dict[str, LazyTensor]:
    """Local experts of ep rank `e` under their global per-expert names (see `experts`)."""
    if not rd.experts_per_rank:
        return named
    hidden = arg(rd.args, "hidden_size")
    return globalize(named, e, rd.experts_per_rank, hidden, file)


def _add(into: dict[str, LazyTensor], tensors: Mapping[str, LazyTensor], file: str) -> None:
    for n, x in tensors.items():
        if n in into:
            raise FormatError(f"{file}: {n!r} is also held by another rank file of this tp rank")
        into[n] = x


# -- optimizer state ---------------------------------------------------------------------------------


def _bucket_sizes(args, p: int, v: int) -> list[int | None]:
    """Bucket sizes to try for model chunk v on pp rank p (distributed_data_parallel.py)."""
    sizes: list[int | None] = [None]
    if arg(args, "overlap_grad_reduce") and p == 0 and v == 0:
        bs = arg(args, "ddp_bucket_size")
        dp = arg(args, "data_parallel_size", 1) or 1
        sizes.insert(0, bs if bs else max(40_000_000, 1_000_000 * dp))
    return sizes


def _specs(chunk: Chunk, shared_names: set[str]) -> list[optim.ParamSpec]:
    return [
        optim.ParamSpec(n, tuple(chunk.tensors[n].shape), n in shared_names)
        for n in chunk.names
        if not is_buffer(n)  # the router's expert_bias: a buffer, no optimizer state
    ]


def _optimizer(
    rd: Reader, chunks, offsets, head_copies: set[str], tied: bool
) -> OptimizerState | None:
    """Slots and masters of every (pp, tp, ep) rank file. With experts Megatron chains two
    optimizers, `[dense, experts]` (optimizer/__init__.py `get_megatron_optimizer`): each rank
    file's list entry 0 covers its non-expert params (read from ep rank 0, the others hold
    copies) and entry 1 its own experts."""
    t, args = rd.topo, rd.args
    if "optimizer" not in rd.state0:
        rd.notes.append("no optimizer state (saved with --no-save-optim)")
        return None
    shared = set()
    if tied and t.pp > 1:  # megatron/core/models/common/language_module/language_module.py
        shared = {EMBEDDING, "output_layer.weight", *HEAD_COPIES}
    moe = bool(rd.experts_per_rank)
    kinds: dict[str, dict[tuple[int, int], dict[str, LazyTensor]]] = {}  # master and slots
    for (p, r, e), f in rd.ep_files.items():
        specs = [
            _specs(
                chunks[(p, r, v, e)],
                shared if (p, v) in ((0, 0), (t.pp - 1, t.vpp - 1)) else set(),
            )
            for v in range(t.vpp)
        ]
        parts = [(0, specs)] if not moe else []
        if moe:
            dense = [[s for s in ch if not is_expert(s.name)] for ch in specs]
            expert = [[s for s in ch if is_expert(s.name)] for ch in specs]
            parts = ([(0, dense)] if e == 0 else []) + [(1, expert)]
        opt = rd.ep_states[(p, r, e)].get("optimizer")
        dist_file = os.path.join(os.path.dirname(f), OPTIM_FILE)
        dist = arg(args, "use_distributed_optimizer") or os.path.isfile(dist_file)
        if dist and not os.path.isfile(dist_file):
            raise FormatError(f"{dist_file}: missing (args.use_distributed_optimizer is set)")
        state = torch_save.load(dist_file) if dist else None
        for part, part_specs in parts:
            if dist:
                decoded = optim.decode_distributed(
                    state,
                    part_specs,
                    [_bucket_sizes(args, p, v) for v in range(t.vpp)],
                    file=dist_file,
                    part=part if moe else 0,
                )
            else:
                flat = optim.decode_torch_state(
                    opt, [s for ch in part_specs for s in ch], file=f, part=part
                )
                if flat is None:
                    rd.notes.append(f"{f}: optimizer holds no per-parameter state")
                    return None
                decoded, i = [], 0
                for ch in part_specs:
                    decoded.append(flat[i : i + len(ch)])
                    i += len(ch)
            for v, ch in enumerate(part_specs):
                per_kind: dict[str, dict[str, LazyTensor]] = {}
                for spec, views in zip(ch, decoded[v], strict=True):
                    g = _global(rd, spec.name, p, v, offsets)
                    for kind, view in views.items():
                        per_kind.setdefault(kind, {})[g] = view
                for kind, named in per_kind.items():
                    into = kinds.setdefault(kind, {}).setdefault((p, r), {})
                    _add(into, _globalize(rd, named, e, f), f)
    merged = {}
    for kind, per_rank in kinds.items():
        if not per_rank:
            continue
        if rd.qkv_rules is not None:
            per_rank = {k: rd.fix_qkv(dict(v), rd.files[k]) for k, v in per_rank.items()}
        m = merge_tp(per_rank, rd.files, rd.tp_rules, t.tp, what=f"optimizer {kind} ")
        for n in head_copies:
            m.pop(n, None)
        merged[kind] = m
    groups = optim.param_groups(rd.state0["optimizer"], rd.first_file)
    hyper = {}
    if groups:  # group 0's, typed (a value of another type names the file: `optim.groups.check_group`)
        g0 = groups[0] if isinstance(groups[0], Mapping) else {}
        hyper = {k: v for k, v in check_group(g0, rd.first_file, "optimizer param_groups[0][{!r}]").items()
                 if k in ("lr", "eps", "weight_decay", "betas")}
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


def _trainer(rd: Reader) -> dict:
    return trainer_metadata(rd.state0, rd.args, rd.iteration, rd.version)


def trainer_metadata(st: Mapping, args, iteration, version) -> dict:
    """The JSON-serialisable trainer metadata of a Megatron state dict `st` (the rank-0 file, or
    a torch_dist checkpoint's common state) and its `args`."""
    out: dict[str, Any] = {"iteration": iteration, "checkpoint_version": version}
    for k in (
        "consumed_train_samples",
        "consumed_valid_samples",
        "seed",
        "seq_length",
        "global_batch_size",
        "make_vocab_size_divisible_by",  # (an export to Megatron pads the vocabulary alike)
        "tokenizer_type",  # (and records it: a run with --vocab-file compares it on load)
    ):
        v = _plain(arg(args, k))
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
