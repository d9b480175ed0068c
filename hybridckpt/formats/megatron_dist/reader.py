"""`open`: a Megatron-Core torch_dist checkpoint as lazy global tensors, slots and metadata.

Finds the checkpoint folder (`layout`), refuses an unfinished save, reads the DCP metadata with
the plain DCP reader (`hybridckpt.io.dcp_metadata`, `formats.dcp.storage`: every chunk a
`torch.save` archive at its global offsets, tiling checked), the common state (`common`), the
model tensors under per-layer global Megatron names (`model`), and the optimizer state
(`optimizer` for model-space formats, `buckets` for `dp_reshardable`). The model config, the
rules to HF names and the rule variables are the legacy Megatron reader's
(`formats.megatron.config`: args -> HF config, `FAMILY_RULES`), as the names after `model` are
the ones that reader produces.
"""

from __future__ import annotations

import os

import models
from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.dcp.storage import check_files, entry_tensor
from hybridckpt.formats.megatron.config import family_rules, model_config, notes_for
from hybridckpt.formats.megatron.layout import arg, topology
from hybridckpt.formats.megatron.reader import trainer_metadata
from hybridckpt.formats.megatron_dist import buckets, common, model, optimizer
from hybridckpt.formats.megatron_dist.layout import Location, check_backend, locate
from hybridckpt.formats.rules_files import load_rules, rules_text
from hybridckpt.formats.torch_optim import check_complete
from hybridckpt.io.dcp_metadata import read_metadata
from hybridckpt.source import OptimizerState, SourceCheckpoint

NAME = "megatron-dist"
EMBEDDING = "embedding.word_embeddings.weight"
# distrib_optimizer.py `sharded_state_dict`: the non-tensor optimizer state of model-parallel
# domain 0 as a ShardedObject (dp_reshardable); its `param_groups` carry the step
GROUPS_OBJECT = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"


def _location(path: str) -> Location:
    loc = locate(path)
    if loc is None:
        raise FormatError(
            f"{path}: not a Megatron-Core torch_dist checkpoint (no iter_N/ with DCP files and "
            f"metadata.json, no NeMo weights/ + context/)"
        )
    return loc


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """Plan the import of a torch_dist checkpoint (reads metadata and the common state; no
    tensor bytes)."""
    loc = _location(path)
    check_backend(loc.folder)
    md = read_metadata(loc.folder)
    check_files(md)
    com = common.read_common(loc.folder, md)
    args = com.state.get("args")
    if args is None:
        raise ConfigError(
            f"{com.where}: no 'args' in the common state ({loc.flavour}); reading the model "
            f"config from NeMo's context/ or Bridge's run_config.yaml is not supported yet"
        )
    file = com.where
    if arg(args, "num_experts") or (arg(args, "expert_model_parallel_size", 1) or 1) > 1:
        raise FormatError(f"{file}: mixture-of-experts checkpoints (num_experts) are not supported")
    cfg = model_config(args, config, file)
    fam = family_rules(cfg, file)
    topo = topology(args, file)
    notes = [
        f"Megatron-Core torch_dist ({loc.flavour}); common state from {os.path.basename(file.split(' ')[0])}"
    ]

    raw = {k: entry_tensor(e) for k, e in md.tensors.items()}
    raw_model, raw_optim = model.split_keys(raw)
    prefix = model.model_prefix(raw_model)
    if prefix:
        notes.append(f"model keys carry NeMo's {prefix!r} prefix")
    num_layers = arg(args, "num_layers")
    tensors = model.global_names(
        raw_model, prefix, md.files[0], num_layers if isinstance(num_layers, int) else None
    )
    if EMBEDDING not in tensors:
        raise FormatError(
            f"{md.files[0]}: no '{prefix}{EMBEDDING}' (keys: {sorted(raw_model)[:5]})"
        )
    tied = not arg(args, "untie_embeddings_and_output_weights", False)
    swiglu = bool(arg(args, "swiglu", False))
    opt = _optimizer(
        com, md, raw_model, raw_optim, tensors, prefix, topo, args, tied, swiglu, notes
    )
    padded = arg(args, "padded_vocab_size") or tensors[EMBEDDING].shape[0]
    rule_vars = {
        **models.rule_variables(cfg),
        "padded_vocab": padded,
        "swiglu": swiglu,
        "tied": tied,
        "te_norms": any(n.endswith(".linear_qkv.layer_norm_weight") for n in tensors),
    }
    notes.extend(
        notes_for(fam, {**rule_vars, "openai_gelu": bool(arg(args, "openai_gelu", False))})
    )
    iteration = com.state.get("iteration", loc.iteration)
    skipped = len(md.bytes_items) - 1
    if skipped > 0:
        notes.append(
            f"skipped {skipped} non-tensor objects (TE extra state, rng state, optimizer metadata)"
        )
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=opt,
        hf_rules=rules_text(fam.hf_rules),
        rule_vars=rule_vars,
        config=cfg,
        step=iteration if isinstance(iteration, int) else None,
        topology={
            "tp": topo.tp,
            "pp": topo.pp,
            "vpp": topo.vpp,
            "dp": topo.dp,
            "files": len({c.path for e in md.tensors.values() for c in e.chunks}),
        },
        trainer=trainer_metadata(com.state, args, iteration, com.state.get("checkpoint_version")),
        notes=tuple(notes),
    )


def _optimizer(
    com, md, raw_model, raw_optim, tensors, prefix, topo, args, tied, swiglu, notes
) -> OptimizerState | None:
    """The optimizer slots (torch names), fp32 masters and step, whichever format holds them."""
    if not raw_optim:
        notes.append("no optimizer state (saved with --no-save-optim)")
        return None
    where = md.files[0]
    kind = common.sharding_type(com.state)
    if any(buckets.BUCKET.match(k) for k in raw_optim):
        kind = (
            kind if kind in ("dp_reshardable", "fully_sharded_bucket_space") else "dp_reshardable"
        )
        tp_rules = load_rules("megatron_tp.rules", {"swiglu": swiglu})
        state = buckets.bucket_state(
            raw_optim, tensors, topo, args, tp_rules, tied=tied, where=where
        )
    elif any(optimizer.is_model_space(k) for k in raw_optim):
        by_key = optimizer.model_space_state(raw_optim, raw_model, where)
        state = {k: model.global_names(v, prefix, where) for k, v in by_key.items()}
        kind = kind or "model space"
    else:
        raise FormatError(
            f"{where}: optimizer state in an unsupported layout (sharding type {kind!r}; keys "
            f"{sorted(raw_optim)[:3]}); dp_zero_gather_scatter is not read"
        )
    masters = [state.pop(k) for k in optimizer.MASTER_KINDS if k in state]
    slots = state
    if not slots:
        raise FormatError(f"{where}: optimizer state holds master weights but no optimizer slots")
    check_complete(slots, where)
    orphans = sorted(set(next(iter(slots.values()))) - set(tensors))
    if orphans:
        raise FormatError(
            f"{where}: optimizer state for {orphans[:3]}, which the model does not hold"
        )
    groups = None  # dp_reshardable: in the domain's `optimizer` object; else in the common state
    for key in (GROUPS_OBJECT, "chained_0." + GROUPS_OBJECT):
        if key in md.bytes_items:
            groups = common.param_groups(common.sharded_object(md, key))
            break
    if groups is None:
        groups = common.param_groups(com.state.get("optimizer"))
    step, hyper = optimizer.step_and_hyper(groups, where)
    if step is None:
        it = com.state.get("iteration")
        step = it if isinstance(it, int) else None
        notes.append("optimizer step not recorded in the param groups: the iteration is used")
    notes.append(
        f"optimizer: distributed optimizer, {kind}"
        if kind != "model space"
        else "optimizer: model-space state"
    )
    return OptimizerState(slots=slots, step=step, master=masters[0] if masters else {}, hyper=hyper)
