"""Export to a torchtitan 0.3 CheckpointManager folder: `hybridckpt export --to torchtitan`.

What `CheckpointManager.load` reads (pytorch/torchtitan 0.3.0: components/checkpointer/dcp.py
`_states_to_load`, `dcp_load`; components/optimizer/utils.py `get_flat_optim_state_dict`), and
what its own save writes (pinned by tests/real/cases/torchtitan_*):
- `OUT/step-{step}/`, a DCP folder (`formats.dcp.write_files`: torch's own files), OUT being the
  trainer's `checkpoint.folder` (the latest `step-N` is what a resume loads);
- the model's own FQNs at the top level: torchtitan's names (`tok_embeddings.weight`,
  `layers.N.attention.qkv_linear.wq.weight`, ..., `lm_head.weight`), from HF names by the
  INVERSE of the reader's rules (`formats.dcp.torchtitan.export_dialect`: the family's
  models/<family>/dialects/torchtitan.rules inverted, so Llama's wq/wk rows go back to Meta's interleaved RoPE order);
  q/k/v split as FusedQKVLinear's state-dict hook saves them; a tied head under both names;
- `optimizer.state.<param fqn>.{step, exp_avg, exp_avg_sq}` keyed by PARAMETER: the moments of
  q/k/v fused into `qkv_linear.wqkv.weight`, rows per kv group `[heads/kv q | k | v]` (the
  reader's rules/torchtitan_fused_qkv.rules inverted), `optimizer.param_groups.<param fqn>.<key>`
  for every key of torchtitan's AdamW group (its `fused` implementation: `fused` True, `foreach`
  False; `initial_lr`, as its LambdaLR adds it);
- `lr_scheduler.last_epoch` (the step: torchtitan's scheduler keeps nothing else),
  `train_state.step` and `train_state.ntokens_seen` (the source's when it is a torchtitan run,
  else 0).
No `dataloader` state is written (the data position belongs to the new job): resume with
`checkpoint.exclude_from_loading = ["dataloader"]` (docs/torch-export.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import CheckpointError, ConfigError
from hybridckpt.formats.dcp import torchtitan
from hybridckpt.formats.dcp import write_request as torch_request
from hybridckpt.formats.dcp.write import ADAMW_DEFAULTS, adamw_group
from hybridckpt.formats.dcp.write_files import Item
from hybridckpt.formats.dcp.write_request import TorchExport
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import parse_rules
from hybridckpt.writers import ExportRequest, Written

# torchtitan 0.3's AdamW (components/optimizer/optimizer.py `default_adamw`, implementation
# "fused"): its defaults where the source recorded none
TITAN_ADAMW = {
    **ADAMW_DEFAULTS,
    "lr": 8e-4,
    "betas": (0.9, 0.95),
    "weight_decay": 0.1,
    "foreach": False,
    "fused": True,
}
HEAD, EMBED = "lm_head.weight", "tok_embeddings.weight"


def titan_names(
    params: Mapping[str, LazyTensor], slots: Mapping[str, Mapping[str, LazyTensor]] | None, cfg: Any
) -> tuple[dict[str, LazyTensor], dict[str, dict[str, LazyTensor]], list[str]]:
    """(model tensors, slots by parameter, notes) under torchtitan 0.3's names (module doc)."""
    from hybridckpt import models

    family = models.family_of(cfg).name
    dialect = torchtitan.export_dialect(family)
    if dialect is None:
        raise ConfigError(f"export --to torchtitan: torchtitan 0.3 has no {family} model here; it writes "
                          f"{torchtitan.export_families()}")  # fmt: skip
    v = {**models.rule_variables(cfg), **dict(dialect.rule_vars)}
    origin = dialect.spec.rules()[1]
    inverse = parse_rules(dialect.rules_text(), v, origin=origin).invert()
    model = inverse.apply(params).tensors
    by_param = {}
    for slot, tensors in (slots or {}).items():
        named = inverse.apply(tensors, strict=False).tensors
        by_param[slot] = torchtitan.fuse_qkv(named, v["num_heads"], v["num_kv_heads"])
    notes = [f"torchtitan {dialect.family} names by {origin} inverted; optimizer state of q/k/v "
             "fused into qkv_linear.wqkv per kv group"]  # fmt: skip
    if v.get("tied") and HEAD not in model and EMBED in model:
        model[HEAD] = model[EMBED]
        notes.append(f"tied head: {HEAD} written as {EMBED} (torchtitan's state dict lists both)")
    return model, by_param, notes


def state_items(
    model: Mapping[str, LazyTensor],
    by_param: Mapping[str, Mapping[str, LazyTensor]],
    step: int,
    group: Mapping[str, Any] | None,
    ntokens: int,
) -> list[Item]:
    """CheckpointManager's flattened state dict: model FQNs at the top level, then the flat
    optimizer (`("optimizer", "state.<fqn>.<slot>")`, `("optimizer", "param_groups.<fqn>.<key>")`),
    `lr_scheduler` and `train_state`."""
    items = [Item((n,), tensor=t) for n, t in model.items()]
    if not by_param:
        return items
    names = list(next(iter(by_param.values())))
    missing = sorted(n for n in names if any(n not in t for t in by_param.values()))
    if missing:
        raise CheckpointError(f"export --to torchtitan: not every slot is there for {missing[:5]}")
    step_t = lazy.ArrayTensor(np.asarray(float(step), dtype=np.float32))
    for n in names:
        items.append(Item(("optimizer", f"state.{n}.step"), tensor=step_t))
        items += [
            Item(("optimizer", f"state.{n}.{s}"), tensor=lazy.cast(t[n], np.float32))
            for s, t in by_param.items()
        ]
    for n in names:
        items += [
            Item(("optimizer", f"param_groups.{n}.{k}"), value=val)
            for k, val in (group or {}).items()
        ]
    items.append(Item(("lr_scheduler", "last_epoch"), value=int(step)))
    items.append(Item(("train_state", "step"), value=int(step)))
    items.append(Item(("train_state", "ntokens_seen"), value=int(ntokens)))
    return items


def write_export(job: TorchExport, *, files: int = 1) -> tuple[list[str], list[str]]:
    """Write `job` (HF-named params, AdamW slots, step, the source's hyper) as a torchtitan 0.3
    checkpoint folder `step-<n>/` of `files` DCP files (module doc); returns (files, notes)."""
    if job.cfg is None:
        raise ConfigError(
            "export --to torchtitan: needs a model config (the source has none; pass --config)"
        )
    job.check_adamw("export --to torchtitan")
    model, by_param, notes = titan_names(job.params, job.slots, job.cfg)
    group = None
    if job.slots:
        group, more = adamw_group(job.hyper, TITAN_ADAMW)
        notes += more
        notes.append(
            "no dataloader state: resume with checkpoint.exclude_from_loading = ['dataloader']"
        )
    ntokens = job.trainer.get("train_state.ntokens_seen", 0)
    n = int(job.step or 0)
    items = state_items(model, by_param, n, group, ntokens if isinstance(ntokens, int) else 0)
    dest = job.destination()
    with dest as tmp:
        folder = os.path.join(tmp, f"step-{n}")
        os.mkdir(folder)
        names = job.write_items(folder, items, files=files, checkpoint_id=os.path.join(dest.dst, f"step-{n}"))
        dest.commit()
    return [f"step-{n}/{name}" for name in names], notes


def write_request(request: ExportRequest) -> Written:
    """A writers-registry entry: `request` (formats/dcp/write_request.py) through `write_export`."""
    return torch_request.run(request, write_export)
