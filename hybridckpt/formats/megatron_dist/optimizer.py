"""Optimizer state in model space: `optimizer.state.<kind>.<model key>`, and the step.

Keys (NVIDIA/Megatron-LM:megatron/core/optimizer/distrib_optimizer.py, dist_checkpointing/
optimizer.py `optim_state_to_sharding_state`): `<kind>` is the fp32 master (`param` in
`fully_reshardable`, `fp32_param` in `fully_sharded_model_space` and the non-distributed
Float16 optimizer) or an optimizer slot under torch's name (`exp_avg`, `exp_avg_sq`); the rest
is the model tensor's key, so the slot has the model tensor's shape, offsets and factories:
- `fully_reshardable` (`sharded_param_state_fully_reshardable`) and the non-distributed
  optimizer: stored with the model tensor's global shape; read like the weights.
- `fully_sharded_model_space` (former default, `sharded_param_state_fs_model_space`; core <= 0.14
  wrote it, strategies/resharding.py `nd_flattened_tensor_reformulated_global_shape`): a model
  tensor of global shape G cut into a grid of F fragments (`axis_fragmentations`, the prepended
  layer axis included) of local shape G/F is stored as `F + (prod(G/F),)`, each fragment's
  elements flattened on the last axis (DP ranks wrote `flattened_range` pieces of it). Read back
  as the tiling of fragment f, unflattened to G/F, at offsets f * G/F.
With a `ChainedOptimizer` the keys may start with `chained_{i}.` (optimizer/optimizer.py).
The step is each param group's `step` (`DistributedOptimizer.state_dict`), from the common state
or from the `optimizer` ShardedObject (see `common`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping

from hybridckpt import lazy, values
from hybridckpt.errors import FormatError
from hybridckpt.lazy import LazyTensor, tiled
from hybridckpt.optim.groups import check_group

MASTER_KINDS = ("param", "fp32_param")
_STATE = re.compile(r"^(?P<chain>chained_\d+\.)?optimizer\.state\.(?P<kind>\w+?)\.(?P<key>.+)$")


def is_model_space(key: str) -> bool:
    return _STATE.match(key) is not None


def unflatten_fragments(t: LazyTensor, shape: tuple[int, ...], where: str) -> LazyTensor:
    """A `fully_sharded_model_space` tensor `F + (n,)` as the model tensor of global `shape`."""
    frag = t.shape[:-1]
    if len(frag) != len(shape) or any(f == 0 or g % f for g, f in zip(shape, frag, strict=True)):
        raise FormatError(f"{where}: shape {t.shape} is no fragment grid of the model's {shape}")
    local = tuple(g // f for g, f in zip(shape, frag, strict=True))
    if math.prod(local) != t.shape[-1]:
        raise FormatError(
            f"{where}: fragments of {t.shape[-1]} elements, but {shape} cut {frag} ways gives "
            f"{local} ({math.prod(local)} elements)"
        )
    pieces = []
    for f in itertools.product(*(range(n) for n in frag)):
        block = t
        for axis, i in enumerate(f):
            block = lazy.slice_axis(block, axis, i, i + 1)
        pieces.append(
            (tuple(i * n for i, n in zip(f, local, strict=True)), lazy.reshape(block, local))
        )
    return tiled(shape, t.dtype, pieces)


def model_space_state(
    tensors: Mapping[str, LazyTensor], model: Mapping[str, LazyTensor], where: str
) -> dict[str, dict[str, LazyTensor]]:
    """kind -> model key -> state tensor in the model tensor's shape (DCP keys of the model)."""
    out: dict[str, dict[str, LazyTensor]] = {}
    for key, t in tensors.items():
        m = _STATE.match(key)
        if m is None:
            continue
        kind, mkey = m.group("kind"), m.group("key")
        ref = model.get(mkey)
        if ref is None:
            raise FormatError(
                f"{where}: '{key}' is optimizer state for '{mkey}', which the checkpoint does not hold"
            )
        if t.shape != ref.shape:
            t = unflatten_fragments(t, ref.shape, f"{where}: '{key}'")
        slot = out.setdefault(kind, {})
        if mkey in slot:
            raise FormatError(
                f"{where}: optimizer state '{kind}' of '{mkey}' is stored twice (chained optimizers)"
            )
        slot[mkey] = t
    return out


def decay_groups(groups, tensors) -> list[dict] | None:
    """Megatron's param groups as torch-style groups naming their params, when they decay
    differently: megatron-core's default (optimizer/__init__.py `_get_param_groups` overrides:
    `wd_mult` 0 for `*.bias` and every 1-D param) says which params each holds, which its saved
    groups do not. None when every group decays alike."""
    wds = {float(g["weight_decay"]) for g in groups if isinstance(g.get("weight_decay"), (int, float))}
    if len(wds) < 2:
        return None
    no_decay = sorted(n for n, t in tensors.items() if n.endswith(".bias") or t.ndim == 1)
    decay = sorted(n for n in tensors if n not in set(no_decay))
    g_decay = next((g for g in groups if g.get("weight_decay")), groups[0])
    g_none = next((g for g in groups if not g.get("weight_decay")), groups[-1])
    return [{**g_decay, "params": decay}, {**g_none, "params": no_decay}]


def step_and_hyper(groups, where: str, tensors=None) -> tuple[int | None, dict]:
    """(step, hyperparameters of group 0: lr, betas, eps, weight_decay) of Megatron's param
    groups (group 0 holds the weight-decayed params: optimizer/__init__.py `_get_param_groups`)."""
    if not groups:
        return None, {}
    groups = [values.mapping(g, where, f"param_groups[{i}]") for i, g in enumerate(groups)]
    steps = {values.integer(g["step"], where, f"param_groups[{i}]['step']")
             for i, g in enumerate(groups) if g.get("step") is not None}
    step = None
    if steps:
        if len(steps) > 1:
            raise FormatError(f"{where}: param groups have different steps {sorted(steps)}")
        step = steps.pop()  # (values.integer read a tensor only when it holds one element)
    hyper = {k: v for k, v in check_group(groups[0], where, "param_groups[0][{!r}]").items()
             if k in ("lr", "eps", "weight_decay", "betas", "decoupled_weight_decay")}
    split = decay_groups(groups, tensors) if tensors is not None else None
    if split is not None:
        from hybridckpt.optim.torch_optim import hyper as torch_hyper

        hyper = {**hyper, "groups": torch_hyper(split, [g["params"] for g in split], where)["groups"]}
    return step, hyper
