"""`open`: a Megatron-Core torch_dist checkpoint as lazy global tensors, slots and metadata.

Finds the checkpoint folder (`layout`), refuses an unfinished save, reads the DCP metadata with
the plain DCP reader (`hybridckpt.containers.dcp_metadata`, `formats.dcp.storage`: every chunk a
`torch.save` archive at its global offsets, tiling checked), the common state (`common`), the
model tensors under per-layer global Megatron names (`model`), and the optimizer state
(`optimizer` for model-space formats, `buckets` for `dp_reshardable`). The model config, the
rules to HF names and the rule variables are the legacy Megatron reader's
(`formats.megatron.config`: args -> HF config, the family's megatron dialect), as the names after `model` are
the ones that reader produces; without `args` they come from Bridge's / NeMo's YAML (`config`)
or from the given `--config` alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hybridckpt import models
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.dcp.storage import check_files, entry_tensor
from hybridckpt.formats.megatron import mtp
from hybridckpt.formats.megatron.config import family_architecture, model_config, notes_for
from hybridckpt.formats.megatron.experts import zero_buffer_state
from hybridckpt.formats.megatron.layout import Topology, arg, topology
from hybridckpt.formats.megatron.model import checked_experts, tp_variables
from hybridckpt.formats.megatron.reader import trainer_metadata
from hybridckpt.formats.megatron_dist import buckets, common, model, optimizer
from hybridckpt.formats.megatron_dist import config as mconfig
from hybridckpt.formats.megatron_dist.layout import Location, check_backend, locate
from hybridckpt.formats.rules_files import load_rules
from hybridckpt.optim.torch_optim import check_complete
from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

NAME = "megatron-dist"
EMBEDDING = "embedding.word_embeddings.weight"
# distrib_optimizer.py `sharded_state_dict`: the non-tensor optimizer state of model-parallel
# domain 0 as a ShardedObject (dp_reshardable); its `param_groups` carry the step
GROUPS_OBJECT = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
# megatron/training/arguments.py: stages of unequal layer counts (transformer_block.py
# `get_transformer_layer_offset`), which the bucket walk does not model
UNEVEN_PIPELINE_ARGS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
)


# a gated delta net layer's in_proj, stored as its sections (megatron-core ssm/gated_delta_net
# common.py `sharded_state_dict`: `in_proj.weight.query` ...)
GATED_DELTA_KEY = ".self_attention.in_proj.weight."


def _location(path: str) -> Location:
    loc = locate(path)
    if loc is None:
        raise FormatError(
            f"{path}: not a Megatron-Core torch_dist checkpoint (no iter_N/ with DCP files and "
            f"metadata.json, no NeMo weights/ + context/)"
        )
    return loc


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """Plan the import of a torch_dist checkpoint (reads metadata, the common state and the
    model config; no tensor bytes)."""
    loc = _location(path)
    check_backend(loc.folder)
    md = read_metadata(loc.folder)
    check_files(md)
    com = common.read_common(loc.folder, md)
    raw = {k: entry_tensor(e) for k, e in md.tensors.items()}
    raw_model, raw_optim = model.split_keys(raw)
    prefix = model.model_prefix(raw_model)
    if prefix + EMBEDDING not in raw_model:
        raise FormatError(
            f"{md.files[0]}: no '{prefix}{EMBEDDING}' (keys: {sorted(raw_model)[:5]})"
        )
    notes = [f"Megatron-Core torch_dist ({loc.flavour})"]
    if prefix:
        notes.append(f"model keys carry NeMo's {prefix!r} prefix")
    m = _model(loc, com, config, raw_model[prefix + EMBEDDING].shape[0], notes)
    topo = _topology(m, md, raw_optim, prefix)
    num_layers = arg(m.args, "num_layers")
    tensors = model.global_names(
        raw_model, prefix, md.files[0], num_layers if isinstance(num_layers, int) else None
    )
    opt = _optimizer(com, md, raw_model, raw_optim, tensors, prefix, topo, m, notes)
    if mtp_layers := mtp.layer_indices(tensors):  # the shared embedding / head, per MTP layer
        added = mtp.add_shared(tensors, mtp_layers, m.tied)
        for slot in [*(opt.slots.values() if opt else ()), *([opt.master] if opt else [])]:
            mtp.add_shared(slot, mtp_layers, m.tied)
        notes.append(f"{', '.join(added)}: the MTP layers' shared embedding / output layer")
    rule_vars = {
        **models.rule_variables(m.cfg),
        "padded_vocab": tensors[EMBEDDING].shape[0],
        "swiglu": m.swiglu,
        "tied": m.tied,
        "te_norms": any(n.endswith(".linear_qkv.layer_norm_weight") for n in tensors),
    }
    notes.extend(
        notes_for(m.arch, {**rule_vars, "openai_gelu": bool(arg(m.args, "openai_gelu", False))})
    )
    iteration = com.state.get("iteration", com.state.get("global_step", loc.iteration))
    skipped = len(md.bytes_items) - (common.COMMON_OBJECT in md.bytes_items)
    if skipped > 0:
        notes.append(
            f"skipped {skipped} non-tensor objects (TE extra state, rng state, optimizer metadata)"
        )
    files = len(md.table.used_files())
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=opt,
        hf_rules=m.arch.dialect.rules_text(),
        rule_vars=rule_vars,
        config=m.cfg,
        step=iteration if isinstance(iteration, int) else None,
        topology={"tp": topo.tp, "pp": topo.pp, "vpp": topo.vpp, "dp": topo.dp, "files": files},
        trainer=trainer_metadata(com.state, m.args, iteration, com.state.get("checkpoint_version")),
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class _Model:
    """What the checkpoint says its model is: `args` (Megatron-LM's, or rebuilt from Bridge's /
    NeMo's YAML; None when only `--config` tells), where they were read, the model config, its
    family's megatron dialect (`config.Architecture`), and the two layout facts the rules need."""

    args: Any
    where: str
    cfg: Any
    arch: Any
    swiglu: bool
    tied: bool
    from_args: bool


def _model(loc: Location, com: common.Common, config, padded: int, notes: list[str]) -> _Model:
    args, where = com.state.get("args"), com.where
    from_args = args is not None
    if args is None:
        src = mconfig.config_source(loc.flavour, loc.folder, loc.context)
        if src is not None:
            where = src[0]
            args = mconfig.transformer_args(mconfig.read_yaml(*src), padded, where)
        elif config is None:
            raise ConfigError(
                f"{com.where}: no 'args' in the common state and no run_config.yaml or "
                f"context/model.yaml beside it; pass --config (the model's HF config.json)"
            )
    told = "the given config" if args is None else os.path.basename(where.split(" ")[0])
    notes.append(f"model config from {told}")
    if args is None:  # only the given config: the layout facts follow from its family's dialect
        cfg = config
        swiglu = family_architecture(cfg, where).swiglu
        tied = bool(models.rule_variables(cfg)["tied"])
    else:
        cfg = model_config(args, config, where)
        swiglu = bool(arg(args, "swiglu", False))
        tied = not arg(args, "untie_embeddings_and_output_weights", False)
    return _Model(args, where, cfg, family_architecture(cfg, where), swiglu, tied, from_args)


def _expert_layout(args, topo: Topology, where: str) -> buckets.ExpertLayout | None:
    """The routed experts' module and counts `args` give (None for a dense model)."""
    num = arg(args, "num_experts")
    if not num:
        return None
    checked_experts(args, topo, where, "the experts' optimizer buckets are read only for experts split like "
                    "the dense layers")  # fmt: skip
    if not arg(args, "moe_grouped_gemm", False):
        module = "sequential"
    elif arg(args, "moe_use_legacy_grouped_gemm", False):
        module = "grouped"
    else:
        module = "te_grouped"
    return buckets.ExpertLayout(module, topo.ep, num // topo.ep, arg(args, "hidden_size"))


def _topology(m: _Model, md, raw_optim, prefix: str) -> Topology:
    """The parallel degrees: Megatron-LM's args, checked against what the bucket keys and the
    embedding's chunks show; without args, those (or the YAML's) alone."""
    seen = buckets.topology_of(raw_optim, md.tensors[prefix + EMBEDDING])
    if m.args is not None and (m.from_args or seen is None):
        topo = topology(m.args, m.where)
        if seen is not None and (seen.tp, seen.pp, seen.vpp) != (topo.tp, topo.pp, topo.vpp):
            raise FormatError(
                f"{m.where}: args say tp={topo.tp} pp={topo.pp} vpp={topo.vpp} but the checkpoint's "
                f"optimizer buckets and embedding chunks show tp={seen.tp} pp={seen.pp} vpp={seen.vpp}"
            )
        return topo
    if seen is not None and m.args is not None:  # the YAML's expert parallel size (buckets
        ep = arg(m.args, "expert_model_parallel_size") or 1  # show the dense domains only)
        return Topology(tp=seen.tp, pp=seen.pp, vpp=seen.vpp, ep=ep, dp=seen.dp)
    return seen or Topology(tp=1, pp=1, vpp=1, ep=1, dp=1)


def _optimizer(
    com, md, raw_model, raw_optim, tensors, prefix, topo, m: _Model, notes
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
        uneven = [a for a in UNEVEN_PIPELINE_ARGS if arg(m.args, a)]
        if uneven:  # the weights still convert; say loudly what is left out
            notes.append(
                f"optimizer state NOT read: args set {uneven} (uneven pipeline stages), which "
                f"the dp_reshardable bucket layout is not rebuilt for"
            )
            return None
        if mtp.layer_indices(tensors):  # the weights still convert; say loudly what is left out
            notes.append(
                "optimizer state NOT read: the MTP layers' place in the dp_reshardable buckets is "
                "not modelled (fully_reshardable state is read)"
            )
            return None
        if any(GATED_DELTA_KEY in n for n in tensors):  # the weights still convert
            notes.append(
                "optimizer state NOT read: the gated delta net's place in the dp_reshardable "
                "buckets (Qwen3-Next) is not modelled"
            )
            return None
        tp_rules = load_rules("megatron_tp.rules", tp_variables(m.args) | {"swiglu": m.swiglu})
        local_spec = arg(m.args, "transformer_impl") == "local"
        state = buckets.bucket_state(
            raw_optim, tensors, topo, tp_rules, tied=m.tied, local_spec=local_spec, where=where,
            experts=_expert_layout(m.args, topo, where),
        )  # fmt: skip
    elif any(optimizer.is_model_space(k) for k in raw_optim):
        by_key = optimizer.model_space_state(raw_optim, raw_model, where)
        layers = arg(m.args, "num_layers")
        layers = layers if isinstance(layers, int) else None
        state = {k: model.global_names(v, prefix, where, layers) for k, v in by_key.items()}
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
    if buffers := zero_buffer_state(tensors, slots):
        notes.append(f"{buffers[0]} ...: router expert_bias buffers, given zero moments")
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
    if groups is None:  # NeMo 2 keeps Lightning's list under the same key
        groups = common.param_groups(com.state.get("optimizer"))
    step, hyper = optimizer.step_and_hyper(groups, where, tensors)
    if step is None:
        it = com.state.get("iteration", com.state.get("global_step"))
        step = it if isinstance(it, int) else None
        notes.append("optimizer step not recorded in the param groups: the iteration is used")
    notes.append(
        f"optimizer: distributed optimizer, {kind}"
        if kind != "model space"
        else "optimizer: model-space state"
    )
    return OptimizerState(slots=slots, step=step, master=masters[0] if masters else {}, hyper=hyper)
