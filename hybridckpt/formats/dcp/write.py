"""Export to a torch Distributed Checkpoint that FSDP2 resumes: `hybridckpt export --to dcp`.

What the standard resume path reads (pytorch/pytorch: torch/distributed/checkpoint/state_dict.py):

    model_sd, optim_sd = get_state_dict(model, optimizer)      # the template, any FSDP2 mesh
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=OUT)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

so the state dict written is `get_state_dict`'s, flattened as `dcp.save` flattens it:
- `model.<fqn>`: every parameter under its module FQN (an HF model's FQNs are its HF names);
  a tied head is in a model's state dict under its own name too (`lm_head.weight`, the
  embedding's tensor), so it is written there as well;
- `optim.state.<fqn>.step` (0-d float32, torch AdamW's step tensor), `.exp_avg`, `.exp_avg_sq`
  (fp32, the param's shape): every moment, keyed by parameter FQN (a tied head has none);
- `optim.param_groups.0.<key>`: one group with every key torch 2.13's AdamW keeps (`lr`,
  `betas`, `eps`, `weight_decay`, `amsgrad`, `maximize`, `foreach`, `capturable`,
  `differentiable`, `fused`, `decoupled_weight_decay`, `initial_lr`) and `params` (the FQNs).
  `dcp.load` fails on a key its template has and the checkpoint lacks, and `set_state_dict`
  copies these values into the optimizer's group: the source's hyperparameters when it
  recorded them (`lr` is the one for the next step), else torch's AdamW defaults (noted).

The files are torch's own (`formats.dcp.write_files`): `__R_0.distcp` for each of `files` writers,
each tensor one chunk or row blocks, `.metadata`. Every value is the source's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import CheckpointError, short_repr
from hybridckpt.formats.dcp import write_request as torch_request
from hybridckpt.formats.dcp.structure import state_split
from hybridckpt.formats.dcp.write_files import Item
from hybridckpt.formats.dcp.write_request import TorchExport
from hybridckpt.lazy import LazyTensor
from hybridckpt.writers import ExportRequest, Written

TIED_HEAD = "lm_head.weight"  # transformers' causal LMs: the head's FQN, tied or not
# torch.optim.AdamW's param group in torch 2.13 (torch/optim/adamw.py, adam.py), in its order
ADAMW_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def adamw_group(
    hyper: Mapping[str, Any], defaults: Mapping[str, Any] = ADAMW_DEFAULTS
) -> tuple[dict, list[str]]:
    """One AdamW param group's values (no `params`) from the source's `hyper` (lr, betas, eps,
    weight_decay, initial_lr), the rest from `defaults`; and notes on what was not known."""
    group = dict(defaults)
    unknown = [k for k in HYPER_KEYS if k not in hyper]
    for k in HYPER_KEYS:
        if k in hyper:
            group[k] = tuple(float(b) for b in hyper[k]) if k == "betas" else float(hyper[k])
    group["initial_lr"] = float(hyper.get("initial_lr", group["lr"]))
    notes = []
    if unknown:
        shown = ", ".join(f"{k}={group[k]}" for k in unknown)
        notes.append(
            f"the source recorded no {'/'.join(unknown)}: param group written with torch's AdamW defaults ({shown})"
        )
    if "groups" in hyper:
        notes.append("the source's param groups differ (e.g. no weight decay on norms); written as one group "
                     "with the first group's values")  # fmt: skip
    return group, notes


def tied_head(params: Mapping[str, LazyTensor], cfg: Any) -> tuple[str, str] | None:
    """(head FQN, embedding FQN) when `cfg` ties the head and `params` hold no head: the one
    non-layer `[vocab, hidden]` tensor is the embedding the head shares."""
    if cfg is None or not getattr(cfg, "tie_word_embeddings", False) or TIED_HEAD in params:
        return None
    from hybridckpt import models

    v = models.rule_variables(cfg)
    want = (v["vocab_size"], v["hidden_size"])
    found = [n for n, t in params.items() if tuple(t.shape) == want and "layers." not in n]
    return (TIED_HEAD, found[0]) if len(found) == 1 else None


def check_names(params: Mapping[str, LazyTensor], model_key: str, where: str) -> None:
    """A CheckpointError when a param's key `<model_key>.<name>` has the form of another
    param's optimizer state (`<opt>state.<fqn>.<slot>` with `<fqn>` a written param, e.g. a
    tensor named `optim.state.w.exp_avg` beside `w`): a DCP reader (ours, `formats.dcp.structure`)
    would read it back as a slot of that param and the tensor would be gone."""
    keys = {f"{model_key}.{n}" for n in params}
    for n in sorted(params):
        for _, fqn in state_split(f"{model_key}.{n}"):
            if fqn != n and any(k == fqn or k.endswith("." + fqn) for k in keys if k != f"{model_key}.{n}"):
                raise CheckpointError(
                    f"{where}: tensor {short_repr(n)} would be the DCP key {short_repr(f'{model_key}.{n}')}, the form "
                    f"of optimizer state of {short_repr(fqn)} (<optimizer>state.<param>.<slot>): read back it would "
                    f"be a slot of {short_repr(fqn)}, not a tensor; rename it (--rules) or export --to hf"
                )


def state_items(
    params: Mapping[str, LazyTensor],
    slots: Mapping[str, Mapping[str, LazyTensor]] | None,
    step: int | None,
    group: Mapping[str, Any] | None,
    *,
    model_key: str = "model",
    optim_key: str = "optim",
    extra_model: Mapping[str, LazyTensor] | None = None,
) -> list[Item]:
    """`get_state_dict`'s state dict as DCP items: `model_key` params (then `extra_model`, e.g. a
    tied head's copy), `optim_key.state.<fqn>.{step, <slot>...}` for every param with slots, and
    param group 0 (`group` plus `params`). A param named like another's state is refused
    (`check_names`)."""
    check_names({**params, **(extra_model or {})}, model_key, "export --to dcp")
    items = [Item((model_key, n), tensor=t) for n, t in {**params, **(extra_model or {})}.items()]
    if not slots:
        return items
    names = [n for n in params if all(n in s for s in slots.values())]
    missing = sorted(n for n in params if n not in names)
    if missing:
        raise CheckpointError(
            f"export: no optimizer state for {missing[:5]} (every param needs its moments)"
        )
    step_t = lazy.ArrayTensor(np.asarray(float(step or 0), dtype=np.float32))
    for n in names:
        items.append(Item((optim_key, "state", n, "step"), tensor=step_t))
        items += [
            Item((optim_key, "state", n, s), tensor=lazy.cast(t[n], np.float32))
            for s, t in slots.items()
        ]
    for k, v in {**dict(group or {}), "params": names}.items():
        items.append(Item((optim_key, "param_groups", 0, k), value=v))
    return items


def write_export(job: TorchExport, *, files: int = 1) -> tuple[list[str], list[str]]:
    """Write `job` (HF-named params, AdamW slots, step, the source's hyper) as a DCP checkpoint
    for `get_state_dict` + `dcp.load` + `set_state_dict` in `files` files (module doc); returns
    (file names, notes)."""
    job.check_adamw("export --to dcp")
    notes: list[str] = []
    group = None
    if job.slots:
        group, notes = adamw_group(job.hyper)
    extra = {}
    tie = tied_head(job.params, job.cfg)
    if tie is not None:
        extra[tie[0]] = job.params[tie[1]]
        notes.append(f"tied head: {tie[0]} written as {tie[1]} (a tied model's state dict lists both; "
                     "the optimizer state is the embedding's)")  # fmt: skip
    items = state_items(job.params, job.slots, job.step, group, extra_model=extra)
    dest = job.destination()
    with dest as tmp:
        names = job.write_items(tmp, items, files=files, checkpoint_id=dest.dst)
        dest.commit()
    return names, notes


def write_request(request: ExportRequest) -> Written:
    """A writers-registry entry: `request` (formats/dcp/write_request.py) through `write_export`."""
    return torch_request.run(request, write_export)
