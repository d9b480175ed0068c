"""From a SourceCheckpoint to model pytrees of lazy tensors and back, by rules only.

Two rule sets do every rename and layout change:
1. the source's `hf_rules` (source names -> single-card HF names), optionally a user's rules;
2. the model family's rules (`models/<family>/hf.rules`: HF names -> params pytree paths).
The Adam moments follow the same rules as their parameters. The inverse direction (pytree ->
HF names, for export) is `RuleSet.invert()` of rule set 2: never written twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import models
from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import RuleSet, parse_rules
from hybridckpt.source import SourceCheckpoint

if TYPE_CHECKING:
    import jax


def rule_variables(cfg) -> dict[str, Any]:
    """Variables a rules text may use, from a model config (`models.rule_variables`)."""
    return models.rule_variables(cfg)


def model_rules(cfg) -> RuleSet:
    """The rules from HF names to the params pytree of `cfg`'s family (`models.hf_rules`)."""
    text, origin = models.hf_rules(cfg)
    return parse_rules(text, models.rule_variables(cfg), origin=origin)


# -- pytree paths ------------------------------------------------------------------------------


def nest(flat: Mapping[str, Any]) -> dict:
    """`{"a.b": x}` -> `{"a": {"b": x}}`."""
    out: dict = {}
    for path, x in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": x}}` -> `{"a.b": x}` (dicts only; other nodes are leaves)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# -- source -> HF names -> tree ------------------------------------------------------------------


@dataclass(frozen=True)
class Named:
    """Params and (optionally) Adam moments under one naming; `step` = optimizer steps taken."""

    params: dict[str, LazyTensor]
    exp_avg: dict[str, LazyTensor] | None = None
    exp_avg_sq: dict[str, LazyTensor] | None = None
    step: int | None = None
    report: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())


def _map_named(named: Named, rules: RuleSet, *, strict: bool, unstack: bool = False) -> Named:
    apply = rules.apply_unstack if unstack else rules.apply
    res = apply(named.params, strict=strict)
    report = list(named.report) + res.report()
    moments = []
    for m in (named.exp_avg, named.exp_avg_sq):
        if m is None:
            moments.append(None)
            continue
        mres = apply(m, strict=False)
        moments.append(mres.tensors)
    return Named(res.tensors, moments[0], moments[1], named.step, tuple(report), named.notes)


def source_to_hf(src: SourceCheckpoint, cfg, *, user_rules: RuleSet | None = None, strict: bool = True) -> Named:
    """Tensors (and moments) of `src` under HF names, by the source's rules (and a user's)."""
    named = Named(
        dict(src.tensors),
        dict(src.optimizer.exp_avg) if src.optimizer else None,
        dict(src.optimizer.exp_avg_sq) if src.optimizer else None,
        src.optimizer.step if src.optimizer and src.optimizer.step is not None else src.step,
        notes=tuple(src.notes),
    )
    if src.optimizer and src.optimizer.master:
        # fp32 master weights are the params the optimizer steps: import them as the params
        named = Named(
            {**named.params, **dict(src.optimizer.master)},
            named.exp_avg,
            named.exp_avg_sq,
            named.step,
            notes=named.notes + ("params taken from the fp32 master weights",),
        )
    variables = {**rule_variables(cfg), **dict(src.rule_vars)}
    if user_rules is not None:
        named = _map_named(named, user_rules, strict=strict)
    if src.hf_rules.strip():
        rules = parse_rules(src.hf_rules, variables, origin=f"{src.format} rules")
        named = _map_named(named, rules, strict=strict)
    return named


def hf_to_tree(hf: Named, cfg, *, strict: bool = True) -> Named:
    """HF-named tensors -> flat pytree paths (`layers.q.kernel`) of `cfg`'s params."""
    import models

    out = _map_named(hf, model_rules(cfg), strict=strict)
    shapes = flatten(models.param_shape_tree(cfg))
    _check_against(out.params, shapes, "params")
    for name, m in (("exp_avg", out.exp_avg), ("exp_avg_sq", out.exp_avg_sq)):
        if m is not None:
            missing = sorted(set(shapes) - set(m))
            if missing:
                raise MappingError(f"optimizer state has no {name} for params {missing[:10]}")
            _check_against(m, shapes, name)
    return out


def _check_against(flat: Mapping[str, LazyTensor], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    missing = sorted(set(shapes) - set(flat))
    unexpected = sorted(set(flat) - set(shapes))
    if missing or unexpected:
        raise MappingError(
            f"{what}: the model expects {sorted(shapes)[:3]}...; missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}"
        )
    for k, s in sorted(shapes.items()):
        if tuple(flat[k].shape) != tuple(s):
            raise MappingError(f"{what}: {k} has shape {tuple(flat[k].shape)}, the model expects {tuple(s)}")


def tree_to_hf(params: Mapping[str, Any], cfg) -> dict[str, LazyTensor]:
    """A params pytree (nested dicts of arrays or lazy tensors) under HF names (derived inverse)."""
    flat = {k: v if isinstance(v, LazyTensor) else lazy.ArrayTensor(np.asarray(v)) for k, v in flatten(params).items()}
    return model_rules(cfg).invert().apply_unstack(flat).tensors


# -- assembling sharded arrays --------------------------------------------------------------------


def to_array(t: LazyTensor, sharding: jax.sharding.Sharding, dtype=None) -> tuple[jax.Array, int]:
    """A global jax.Array of `t` placed by `sharding`, and the checksum (`hybridckpt.checksum`)
    of the boxes this process owns.

    Each distinct box of this process's devices is read once, by the reader pool
    (`hybridckpt.io.parallel`, at most `io_threads()` boxes held at a time), into its own buffer,
    which goes straight to every device holding it (`jax.device_put` per shard): no host copy
    of the global array is ever made, and reads overlap host-to-device transfers.
    """
    import jax

    from hybridckpt import checksum, checksum_fast
    from hybridckpt.io import parallel

    if dtype is not None:
        t = lazy.cast(t, dtype)
    shape = tuple(t.shape)
    holders: dict = {}
    for dev, index in sharding.addressable_devices_indices_map(shape).items():
        holders.setdefault(lazy.normalize_box(shape, index), []).append(dev)
    # count each distinct box once across all processes: the process of the lowest-id device
    # holding a box owns it (replicated boxes are read by several processes)
    owner: dict = {}
    for dev, index in sharding.devices_indices_map(shape).items():
        box = lazy.normalize_box(shape, index)
        if box not in owner or dev.id < owner[box].id:
            owner[box] = dev
    me = jax.process_index()

    def read(box):
        buf = parallel.read_box_parallel(t, box)
        part = checksum_fast.box_part(shape, box, buf) if owner[box].process_index == me else 0
        return box, buf, part

    shards: list[jax.Array] = []
    parts: list[int] = []
    for box, buf, part in parallel.imap_bounded(read, list(holders), parallel.io_threads()):
        parts.append(part)
        shards.extend(jax.device_put(buf, dev) for dev in holders[box])
        del buf
    arr = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return arr, checksum.combine(parts)


def assemble(
    tree: Mapping[str, Any], shardings: Mapping[str, Any], dtype=None, on_leaf=None, checksums=None, prefix=""
) -> dict:
    """Nested dict of LazyTensors -> nested dict of jax.Arrays placed by matching `shardings`.

    checksums: a dict that receives `prefix + path -> checksum hex` per leaf.
    """
    from hybridckpt.checksum import to_hex

    flat_s = flatten(shardings)
    out = {}
    for k, t in flatten(tree).items():
        out[k], crc = to_array(t, flat_s[k], dtype)
        if checksums is not None:
            checksums[prefix + k] = to_hex(crc)
        if on_leaf:
            on_leaf(k, t.nbytes)
    return nest(out)


def lazy_leaves(
    tree: Mapping[str, Any],
    shardings: Mapping[str, Any],
    dtype=None,
    *,
    options=None,
    prefix: str = "",
    chunk_axes: Mapping[str, Any] | None = None,
) -> dict:
    """Nested dict of LazyTensors -> nested dict of `stream.LazyLeaf`s placed by `shardings`
    (cast to `dtype` when given): nothing is read until a streaming save writes them.

    chunk_axes: optional matching tree of per-leaf axes chunked with extent 1 (`(0,)` for
    stacked `[layers, ...]` leaves).
    """
    from hybridckpt.stream import LazyLeaf

    flat_s = flatten(shardings)
    flat_c = flatten(chunk_axes) if chunk_axes is not None else {}
    out = {}
    for k, t in flatten(tree).items():
        if dtype is not None:
            t = lazy.cast(t, dtype)
        out[k] = LazyLeaf(t, flat_s[k], prefix + k, tuple(flat_c.get(k, ())), options)
    return nest(out)
