"""The model and optimizer files of an accelerate / Trainer folder, as lazy tensors and slots.

- `pytorch_model_fsdp_K/` (FSDP `SHARDED_STATE_DICT`): a DCP folder of `{"model": state_dict}`,
  keys `model.<fqn>` (the Trainer's fqn of `LlamaForCausalLM` is `model.layers...`, so the keys
  read `model.model.layers...`).
- `optimizer_K/`: a DCP folder of `{"optimizer": osd}`, where `osd` is FSDP2's
  `get_optimizer_state_dict` / FSDP1's `FSDP.optim_state_dict`: keyed by fqn, so
  `optimizer.state.<fqn>.<slot>` (0-d `step`), `optimizer.param_groups.G.{lr, betas, ...,
  params}` (params: the fqns of group G).
- `pytorch_model_fsdp_K.bin`, `optimizer_K.bin` (FSDP `FULL_STATE_DICT`): torch.save of the
  same dicts, whole, written by rank 0.
- `optimizer.pt` / `optimizer.bin` (no FSDP, no DeepSpeed): torch's `Optimizer.state_dict()`,
  state keyed by parameter INDEX in the order the params were given to the optimizer; names
  only when the optimizer was built from named parameters (torch >= 2.6: `param_names` in each
  group). Without them it is read as an `IndexKeyedOptimizer` (`formats.index_optim`), named
  where the model config is known (`optim.index_names`, from the model's `named_parameters()`
  order and the tool's grouping).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError, short_repr
from hybridckpt.formats import index_optim
from hybridckpt.formats.dcp.storage import check_files, entry_tensor, safetensors_blobs
from hybridckpt.formats.dcp.structure import param_groups
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim import torch_optim
from hybridckpt.source_checkpoint import IndexKeyedOptimizer

MODEL_KEY = "model."  # accelerate's `{"model": state_dict}`
OPTIM_KEY = "optimizer."  # accelerate's `{"optimizer": optim_state}`


def dcp_model(folder: str) -> dict[str, LazyTensor]:
    """The tensors of a `pytorch_model_fsdp_K/` DCP folder under the model's own fqns."""
    md = read_metadata(folder)
    check_files(md)
    blobs = safetensors_blobs(md)
    out = {}
    for k, e in md.tensors.items():
        if not k.startswith(MODEL_KEY):
            raise FormatError(f"{md.files[0]}: key {short_repr(k)}: expected accelerate's 'model.<fqn>' keys")
        out[k[len(MODEL_KEY):]] = entry_tensor(e, blobs)
    if not out:
        raise FormatError(f"{md.files[0]}: no model tensors")
    return out


def dcp_optimizer(folder: str) -> tuple[dict[str, dict[str, LazyTensor]], int | None, dict, list[str]]:
    """(slots, step, hyper, notes) of an `optimizer_K/` DCP folder."""
    md = read_metadata(folder)
    check_files(md)
    blobs = safetensors_blobs(md)
    state = OPTIM_KEY + "state."
    slots: dict[str, dict[str, LazyTensor]] = {}
    steps: dict[str, float] = {}
    for k, e in md.tensors.items():
        if not k.startswith(state):
            continue
        name, _, slot = k[len(state):].rpartition(".")
        if not name:
            raise FormatError(f"{md.files[0]}: key {short_repr(k)}: expected 'optimizer.state.<fqn>.<slot>'")
        t = entry_tensor(e, blobs)
        if slot == torch_optim.STEP:
            if t.shape != ():
                raise FormatError(f"{md.files[0]}: {short_repr(k)}: a step is 0-d, found shape {t.shape}")
            steps[name] = float(t.materialize())
        else:
            slots.setdefault(slot, {})[name] = t
    groups = param_groups(md, OPTIM_KEY)
    hyper = torch_optim.hyper(groups, [[p for p in torch_optim.group_params(g, md.files[0], i) if isinstance(p, str)]
                                       for i, g in enumerate(groups)], md.files[0])
    return slots, *_one_step(steps, md.files[0]), hyper


def _one_step(steps: Mapping[str, float], where: str) -> tuple[int | None, list[str]]:
    values = set(steps.values())
    if not values:
        return None, []
    step = int(max(values))
    notes = [] if len(values) == 1 else [f"{where}: params have different optimizer steps {sorted(values)[:5]}; using {step}"]
    return step, notes


def full_model(path: str) -> dict[str, LazyTensor]:
    """A torch.save'd full state dict (`pytorch_model_fsdp_K.bin`, `pytorch_model.bin`)."""
    sd = torch_save.load(path)
    if not isinstance(sd, Mapping):
        raise FormatError(f"{path}: expected a state dict, found {type(sd).__name__}")
    out = {k: v for k, v in sd.items() if isinstance(k, str) and isinstance(v, LazyTensor)}
    if not out:
        raise FormatError(f"{path}: no tensors")
    return out


def torch_optimizer(path: str, params: Mapping[str, LazyTensor], tool: str = "trainer"
                    ) -> tuple[dict, int | None, dict, list[str], IndexKeyedOptimizer | None]:
    """(slots, step, hyper, notes, by_index) of a torch.save'd optimizer state dict: keyed by fqn
    (`optimizer_K.bin` of FSDP FULL_STATE_DICT), or by index with `param_names` in its groups;
    an index-keyed one without names gives no slots but `by_index`, written by `tool` (see the
    module doc)."""
    sd = torch_save.load(path)
    if not isinstance(sd, Mapping) or not isinstance(sd.get("state"), Mapping):
        raise FormatError(f"{path}: expected a torch optimizer state dict with 'state'")
    groups = sd.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise FormatError(f"{path}: 'param_groups': expected a list of dicts")
    state = sd["state"]
    by_index: dict[object, str] = {}
    for i, g in enumerate(groups):
        ids, pnames = torch_optim.group_params(g, path, i), g.get("param_names")
        if isinstance(pnames, list) and len(pnames) == len(ids):
            by_index.update(zip(ids, pnames, strict=True))
    group_names = [[by_index.get(i, i) if not isinstance(i, str) else i for i in torch_optim.group_params(g, path, n)]
                   for n, g in enumerate(groups)]
    keys = list(state)
    if keys and not all(isinstance(k, str) for k in keys) and not all(k in by_index for k in keys):
        return {}, None, torch_optim.hyper(groups, [[] for _ in groups], path), [], index_optim.read(sd, path, tool)
    slots: dict[str, dict[str, LazyTensor]] = {}
    steps: dict[str, float] = {}
    for key, entry in state.items():
        name = key if isinstance(key, str) else by_index[key]
        if not isinstance(name, str):
            raise FormatError(f"{path}: state key {short_repr(key)}: expected a parameter name")
        got, step = torch_optim.param_state(entry, f"{path}: state[{short_repr(key)}]")
        for slot, t in got.items():
            slots.setdefault(slot, {})[name] = t
        if step is not None:
            steps[name] = step
    torch_optim.check_complete(slots, path)
    names = [[n for n in g if isinstance(n, str)] for g in group_names]
    unknown = sorted(n for g in names for n in g if n not in params)
    notes = [f"{path}: param_groups name {unknown[:3]}, which the model does not hold"] if unknown else []
    step, more = _one_step(steps, path)
    return slots, step, torch_optim.hyper(groups, names, path), notes + more, None


def optimizer_file(folder: str, names: list[str]) -> str | None:
    """The one optimizer file or folder of the listed names that is present."""
    found = [n for n in names if os.path.exists(os.path.join(folder, n))]
    if len(found) > 1:
        raise FormatError(f"{folder}: several optimizer states {found}: hybridckpt reads one model and one optimizer")
    return os.path.join(folder, found[0]) if found else None
