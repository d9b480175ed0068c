"""Where an index-keyed optimizer state gets its names: once the model config is known.

A reader that finds a torch optimizer state keyed by parameter index (`formats.index_optim`)
sets `SourceCheckpoint.index_optimizer` and no `optimizer`; its registry line declares
`names="...index_naming:name_index_keyed"`, which `formats.registry.open_source` runs right after
the reader, so the source leaves the registry with its optimizer named like any other format's
(a reader that names its optimizer itself, DeepSpeed's or Megatron's, needs no such line).
`resolve` names it, before the renames of `naming` run, so the slots travel under the source's names like any other format's:
the model's params (the source's tensors under HF names, `naming.leaf_namer`, those the model
has, `naming.model_hf_shapes`) in `named_parameters()` order (`optim.param_order`), grouped by
the writing tool's rule, or the names given (`--param-order FILE` / `param_order=`), checked
against the state (`optim.index_names`). Without a config or names the state stays out, said
in a note. `read_order_file` is the one IO here: a `--param-order` file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hybridckpt.errors import ConfigError, FormatError, MappingError
from hybridckpt.optim import index_names
from hybridckpt.source_checkpoint import SourceCheckpoint

MAX_ORDER_BYTES = 64 << 20  # a --param-order file larger than this is no list of names


def read_order_file(path: str | os.PathLike) -> list[str]:
    """The names of a `--param-order` file: one parameter name a line, in index order (blank
    lines and surrounding spaces ignored); a ConfigError when it cannot be read."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_ORDER_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"--param-order {path}: {e.strerror or e}") from None
    if len(data) > MAX_ORDER_BYTES:
        raise ConfigError(f"--param-order {path}: larger than {MAX_ORDER_BYTES} bytes; expected one name a line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--param-order {path}: not UTF-8 text (byte {e.start}); expected one name a line") from None
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise ConfigError(f"--param-order {path}: no names; expected one parameter name a line, in index order")
    return names


class IfIndexKeyed(tuple):
    """Parameter names in index order for whichever checkpoint holds an index-keyed optimizer
    state (`verify`'s two sides), not refused by one that holds none; `source` names them."""

    either_side = True  # (`registry.open_source` refuses any other param_order a format cannot use)

    def __new__(cls, names: Sequence[str], source: str):
        self = super().__new__(cls, names)
        self.source = source
        return self


def order_arg(param_order: Any) -> tuple[list[str] | None, str]:
    """(names, how to name their source in messages) of `param_order=`: a sequence of names, a
    file path (`read_order_file`), or None."""
    if param_order is None:
        return None, ""
    if isinstance(param_order, IfIndexKeyed):
        return list(param_order), param_order.source
    if isinstance(param_order, str | os.PathLike):
        return read_order_file(param_order), f"--param-order {os.fspath(param_order)}"
    if isinstance(param_order, Sequence) and all(isinstance(n, str) for n in param_order):
        return list(param_order), "param_order="
    raise ConfigError(f"param_order=: expected a sequence of parameter names or a file path, "
                      f"found {type(param_order).__name__}")


def name_index_keyed(src: SourceCheckpoint, cfg: Any, param_order: Any = None, *,
                     rules: str | os.PathLike | None = None) -> SourceCheckpoint:
    """The registry's `names` hook (module doc): `resolve` with the user's `--rules` file, if
    any, read against the source (`naming.user_rules`)."""
    from hybridckpt import naming

    user_rules = naming.user_rules(src, cfg, rules) if rules else None
    return resolve(src, cfg, param_order, user_rules=user_rules)


def resolve(src: SourceCheckpoint, cfg: Any, param_order: Any = None, *, user_rules=None) -> SourceCheckpoint:
    """`src` with its index-keyed optimizer state named (module doc); `src` itself when it has
    none (a `param_order` given then is refused: a flag is honoured or refused)."""
    names, source = order_arg(param_order)
    ko = src.index_optimizer
    if ko is None:
        if names is not None and not isinstance(param_order, IfIndexKeyed):
            raise ConfigError(f"{source}: {src.path} holds no optimizer state keyed by parameter index "
                              f"(the {src.format} reader names its optimizer itself): nothing to order")
        return src
    base = os.path.basename(ko.path)
    if cfg is None and names is None:
        note = (f"{base}: optimizer state keyed by parameter index: not imported (its names follow from the "
                f"model's named_parameters() order: give a model config (--config) or --param-order)")
        return replace(src, notes=(*src.notes, note))
    shapes, rename = _params(src, cfg, user_rules)
    if names is not None:
        opt, notes = index_names.named(ko, index_names.given(ko, names, shapes, source), shapes, rename)
    else:
        opt, notes = _by_rule(src, ko, cfg, shapes, rename)
    step = src.step if src.step is not None else opt.step
    return replace(src, optimizer=opt, step=step, notes=(*notes, *src.notes))


def _params(src: SourceCheckpoint, cfg: Any, user_rules) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(the model's params by the names an index maps to -> shape, those names -> the source's
    name where it differs): HF names of the params the model has when there is a config, else
    the source's tensors as they are."""
    if cfg is None:
        return {n: tuple(t.shape) for n, t in src.tensors.items()}, {}
    from hybridckpt import models, naming

    hf_of = naming.leaf_namer(src, cfg, user_rules=user_rules, tree=False)
    to_src: dict[str, str] = {}
    hf_names: dict[str, None] = {}
    for n, t in src.tensors.items():
        hf = hf_of(n)
        if not hf:  # a stacked source (fused experts): its names by the renames themselves, on a placeholder
            one = replace(src, tensors={n: _placeholder(tuple(t.shape))}, optimizer=None, index_optimizer=None)
            hf = list(naming.source_to_hf(one, cfg, user_rules=user_rules, strict=False).params)
        hf_names.update(dict.fromkeys(hf))
        if len(hf) == 1:  # (a tensor the source's rules split, as fused experts, keeps its own name)
            to_src[hf[0]] = n
    model = naming.model_hf_shapes(models.fit_to_hf_names(cfg, list(hf_names)))
    shapes = {h: tuple(model[h]) for h in hf_names if h in model}
    return shapes, {h: s for h, s in to_src.items() if h in shapes and h != s}


def _by_rule(src: SourceCheckpoint, ko, cfg: Any, shapes: dict, rename: dict):
    """(state, notes) named by the tool's rule over the model's `named_parameters()`: under the
    HF names, or, for a family whose live transformers model holds its params otherwise than its
    HF files name them (transformers 5's fused MoE experts, `mlp.experts.gate_up_proj` [X, 2M, E]:
    the family's `hf_name_fixes`), under those names, the moments then taken to the source's
    names by the same rules (each expert a lazy slice of the fused moment). The order is spelt
    with the prefixes the names use (a wrapper's text and tower parts: `models.fit_to_hf_names`)."""
    from hybridckpt import models
    from hybridckpt.optim.param_order import named_parameters

    cfg = models.fit_to_hf_names(cfg, list(shapes))
    try:
        return index_names.named(ko, index_names.by_rule(ko, named_parameters(cfg, list(shapes))), shapes, rename)
    except MappingError as e:
        live = _live_names(cfg, shapes)
        if live is None:
            raise FormatError(f"{ko.path}: an optimizer state keyed by index: {e}; {index_names.HINT}") from None
    live_shapes, rules = live
    try:
        order = named_parameters(cfg, list(live_shapes))
    except MappingError as e:
        raise FormatError(f"{ko.path}: an optimizer state keyed by index: {e}; {index_names.HINT}") from None
    opt, notes = index_names.named(ko, index_names.by_rule(ko, order), live_shapes)
    if all(n in src.tensors for n in live_shapes):  # the source holds the live names: its rules split them
        return opt, notes
    slots = {s: {rename.get(h, h): t for h, t in rules.for_slot(s).apply_unstack(dict(v), strict=False).tensors.items()}
             for s, v in opt.slots.items()}
    hyper = dict(opt.hyper)

    def targets(n: str) -> list[str]:  # (a fused name's per-expert names: the rules on a placeholder)
        return [rename.get(h, h) for h in rules.apply_unstack({n: _placeholder(live_shapes[n])}, strict=False).tensors]

    if "groups" in hyper:
        hyper["groups"] = [{**g, "params": [h for n in g["params"] for h in targets(n)]} for g in hyper["groups"]]
    return replace(opt, slots=slots, hyper=hyper), notes


def _placeholder(shape: tuple[int, ...]):
    """A tensor of `shape` that owns no memory (a broadcast zero): for planning names only."""
    import numpy as np

    from hybridckpt import lazy

    return lazy.ArrayTensor(np.broadcast_to(np.zeros((), np.float32), shape))


def _live_names(cfg: Any, shapes: dict) -> tuple[dict[str, tuple[int, ...]], Any] | None:
    """(the params `shapes` (HF names) under the names a live transformers model holds them by
    -> shape, the rules from those to the HF names), or None when the family names them alike."""
    from hybridckpt import models
    from hybridckpt.optim.param_order import declared_order
    from hybridckpt.rules import parse_rules

    probe = [t.replace("$", "0") for t in declared_order(cfg)]
    fixes = models.hf_name_fixes(cfg, probe)
    if not fixes.strip():
        return None
    rules = parse_rules(fixes, models.rule_variables(cfg), origin=f"{models.family_of(cfg).name} name fixes")
    flat = {k: _placeholder(s) for k, s in shapes.items()}
    try:
        live = rules.invert().apply(flat, strict=True).tensors
    except MappingError:
        return None
    return {k: tuple(t.shape) for k, t in live.items()}, rules
