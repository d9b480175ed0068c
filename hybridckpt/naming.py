"""Names: from a source's names to single-card HF names to the Flax tree, and back, by rules only.

Two rule sets do every rename and layout change:
1. the source's `hf_rules` (source names -> single-card HF names), optionally a user's rules;
2. the model family's rules (`models.hf_rules(cfg)`: HF names -> flat params tree paths such as
   `layers.q.kernel`, per-layer tensors stacked on a leading `[L]` axis).
Optimizer slots follow the same rules as their parameters (a slot shaped like its param takes
the same layout ops). The inverse direction (tree -> HF names) is `RuleSet.invert()` of rule set
2, never written twice; `model_hf_shapes` derives the HF names and shapes a model has from it,
without reading or allocating anything.

A checkpoint's tensors are handled as a `Named`: params and slots under one naming. Every job
goes to HF names once (`source_to_hf` or the store's `tree_to_hf`), then to the tree once (import)
or stays there (export, verify: `model_hf`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import ConfigError, MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.models import table
from hybridckpt.rules import RuleSet, parse_rules
from hybridckpt.source_checkpoint import SourceCheckpoint


def nest(flat: Mapping[str, Any]) -> dict:
    """`{"a.b": x}` -> `{"a": {"b": x}}`; a name that is also another name's prefix is a
    MappingError (`models.table.nest`, the one nesting, with this module's error)."""
    return table.nest(flat, MappingError, "tensor name")


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


@dataclass(frozen=True)
class Named:
    """Params and optimizer slots under one naming.

    params: name -> tensor
    slots:  slot name (e.g. "exp_avg") -> name -> tensor; empty when there is no optimizer state
    step:   optimizer steps taken, when known
    report: rule-application remarks (rules that matched nothing, ...)
    notes:  remarks carried from the source
    """

    params: dict[str, LazyTensor]
    slots: dict[str, dict[str, LazyTensor]] = field(default_factory=dict)
    step: int | None = None
    report: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def optimizer(self):
        """The declared optimizer of the slots (`hybridckpt.optim`), or None without slots."""
        if not self.slots:
            return None
        from hybridckpt import optim

        return optim.for_slots(self.slots)

    def only(self, names) -> Named:
        """The same with params and slots restricted to `names`."""
        keep = set(names)
        return replace(
            self,
            params={k: v for k, v in self.params.items() if k in keep},
            slots={s: {k: v for k, v in t.items() if k in keep} for s, t in self.slots.items()},
        )


def map_named(named: Named, rules: RuleSet, *, strict: bool, unstack: bool = False, user: bool = False) -> Named:
    """Apply `rules` to params (strictly: every name must be consumed) and to every slot (with
    `RuleSet.for_slot`: a param's value op rescales its moments). `user`: the rules are the
    user's (`--rules`), whose rules that matched nothing are reported."""
    res = (rules.apply_unstack if unstack else rules.apply)(named.params, strict=strict)
    slots = {}
    for s, t in named.slots.items():  # a value op on a param rescales its moments (`Op.for_slot`)
        slot_rules = rules.for_slot(s)
        slots[s] = (slot_rules.apply_unstack if unstack else slot_rules.apply)(t, strict=False).tensors
    return replace(named, params=res.tensors, slots=slots, report=named.report + tuple(res.report(unused=user)))


def source_named(src: SourceCheckpoint) -> Named:
    """A source's tensors and slots under its own names; fp32 master weights, where the source
    keeps them apart from 16-bit weights, are the params (they are what the optimizer steps)."""
    opt = src.optimizer
    params = dict(src.tensors)
    notes = tuple(src.notes)
    if opt is not None and opt.master:
        params |= dict(opt.master)
        notes += ("params taken from the fp32 master weights",)
    slots = {k: dict(v) for k, v in opt.slots.items()} if opt is not None else {}
    step = opt.step if opt is not None and opt.step is not None else src.step
    return Named(params, slots, step, notes=notes)


def source_to_hf(
    src: SourceCheckpoint, cfg: Any, *, user_rules: RuleSet | None = None, strict: bool = True
) -> Named:
    """Tensors and slots of `src` under HF names, by the user's rules, then the source's, then the
    family's name fixes (`models.hf_name_fixes`). All apply with `apply_unstack`: a rule whose source is stacked (`experts.w[$E]`) takes a tensor
    with a leading experts axis apart into per-expert HF names (grouped expert weights)."""
    from hybridckpt import models

    named = source_named(src)
    if user_rules is not None:
        named = map_named(named, user_rules, strict=strict, unstack=True, user=True)
    variables = {**models.rule_variables(cfg), **dict(src.rule_vars)}
    if src.hf_rules.strip():
        rules = parse_rules(src.hf_rules, variables, origin=f"{src.format} rules")
        named = map_named(named, rules, strict=strict, unstack=True)
    # The family's alternate HF spellings, whatever format carried them: a DCP or DeepSpeed save
    # of a live transformers 5 MoE model holds its fused in-memory experts (`mlp.experts.
    # gate_up_proj`), not the Hub's per-expert names. "" once the names are the Hub's.
    fixes = models.hf_name_fixes(cfg, named.params)
    if fixes.strip():
        rules = parse_rules(fixes, variables, origin=f"{models.family_of(cfg).name} name fixes")
        named = map_named(named, rules, strict=strict, unstack=True)
    return named


def named_for_model(src: SourceCheckpoint, cfg: Any, *, rules: str | None = None, strict: bool = True
                    ) -> tuple[Named, Any]:
    """(tensors and slots of `src`, the config that fits them): under HF names when there is a
    model config `cfg` (user `rules` first, then the source's, then the family's name fixes;
    the config fitted to the parts the checkpoint holds, `models.fit_to_hf_names`), else under
    the source's own names (user `rules` alone). A config whose model is not the checkpoint's
    (fewer than half of its tensors found) is one ConfigError saying so, before any rule's."""
    from hybridckpt import models
    named = source_named(src)
    user = user_rules(src, cfg, rules) if rules else None
    if cfg is None:
        return (map_named(named, user, strict=strict, user=True) if user is not None else named), None
    try:
        named = source_to_hf(src, cfg, user_rules=user, strict=strict)
    except MappingError:
        _check_fits(src, None, cfg)
        raise
    cfg = models.fit_to_hf_names(cfg, named.params)  # parts a checkpoint may leave out
    _check_fits(src, named, cfg)
    return named, cfg


def user_rules(src: SourceCheckpoint, cfg: Any, rules: str | os.PathLike) -> RuleSet:
    """A user's `--rules` file read against `src`'s names, with the variables of the model config
    `cfg` (the source's own rule variables without one)."""
    from hybridckpt import models
    from hybridckpt.rules.user import load_user_rules

    variables = dict(src.rule_vars) if cfg is None else models.rule_variables(cfg)
    return load_user_rules(os.fspath(rules), variables, source_named(src).params)


def _check_fits(src: SourceCheckpoint, named: Named | None, cfg: Any) -> None:
    """A ConfigError when the config's model is not the checkpoint's (fewer than half of the
    model's tensors found under its HF names): said plainly, before any rule's error."""
    from hybridckpt import models

    want = model_hf_shapes(cfg)
    have = set(named.params) if named is not None else set()
    fam = models.family_of(cfg)
    missing = sorted(set(want) - have)
    others = _families_fitting(cfg, have) if missing and have else []
    if others:  # another family's model is the checkpoint's: say that, not the missing keys
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        which = others[0] if len(others) == 1 else f"{', '.join(others[:-1])} or {others[-1]}"
        raise ConfigError(
            f"{src.path}: the config is {fam.name}, but the checkpoint's tensors are those of a {which} model "
            f"({', '.join(missing[:4])}{more} missing); pass the checkpoint's own config"
        )
    if named is not None and 2 * len(have & set(want)) >= len(want):
        return
    arch = ", ".join(fam.hf_architectures)
    theirs = sorted(src.tensors)[:3]
    raise ConfigError(
        f"{src.path}: the config describes a {fam.name} model ({arch}), but this {src.format} "
        f"checkpoint's tensors are not that model's (the model expects names like "
        f"{sorted(want)[:2]}, the checkpoint has {theirs}); pass the checkpoint's own config"
    )


def _families_fitting(cfg: Any, names: set[str]) -> list[str]:
    """The other families whose model, with `cfg`'s sizes (its HF config under their
    architecture), has every one of its tensors among `names`, the most tensors first: what the
    checkpoint is when `cfg`'s own model wants tensors it lacks. Tried only on that error path."""
    from hybridckpt import models

    mine = models.family_of(cfg)
    hf = models.config_to_hf(cfg)
    fits = []
    for fam in models.families().values():
        if fam is mine or not fam.hf_architectures:
            continue
        d = {**hf, "architectures": [fam.hf_architectures[0]]}
        if fam.hf_model_types:
            d["model_type"] = fam.hf_model_types[0]
        try:
            other = models.fit_to_hf_names(models.config_from_hf(d, source="config.json"), names)
            want = set(model_hf_shapes(other))
        except Exception:  # noqa: BLE001 - a family whose config these sizes do not make: not a fit
            continue
        if want and want <= names:
            fits.append((-len(want), fam.name))
    return [name for _, name in sorted(fits)]


def model_rules(cfg: Any) -> RuleSet:
    """The family's rules from HF names to the flat params tree of `cfg`."""
    from hybridckpt import models

    text, origin = models.hf_rules(cfg)
    return parse_rules(text, models.rule_variables(cfg), origin=origin)


def _check_against(flat: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
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


def hf_to_tree(hf: Named, cfg: Any, *, strict: bool = True) -> Named:
    """HF-named params and slots -> flat tree paths (`layers.q.kernel`) of `cfg`'s params,
    checked against the model's shapes (every slot must cover every param)."""
    from hybridckpt import models

    out = map_named(hf, model_rules(cfg), strict=strict)
    shapes = flatten(models.param_shape_tree(cfg))
    _check_against(out.params, shapes, "params")
    for name, tree in out.slots.items():
        missing = sorted(set(shapes) - set(tree))
        if missing:
            raise MappingError(f"optimizer state has no {name} for params {missing[:10]}")
        _check_against(tree, shapes, name)
    return out


def _placeholder(shape: tuple[int, ...]) -> LazyTensor:
    """A tensor of `shape` that owns no memory (a broadcast zero): for planning names only."""
    return lazy.ArrayTensor(np.broadcast_to(np.zeros((), np.float32), shape))


def model_hf_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of every tensor `cfg`'s model has (derived from the inverse of
    the family's rules; nothing read or allocated)."""
    from hybridckpt import models

    flat = {k: _placeholder(tuple(s)) for k, s in flatten(models.param_shape_tree(cfg)).items()}
    return {k: tuple(t.shape) for k, t in model_rules(cfg).invert().apply_unstack(flat).tensors.items()}


def model_hf(hf: Named, cfg: Any) -> Named:
    """The model's tensors of an HF-named checkpoint (buffers and tied copies the model does not
    hold dropped), with every name and shape checked: what export writes and verify compares."""
    hf_to_tree(hf, cfg)  # every name consumed by a rule, every shape the model's (reads nothing)
    want = model_hf_shapes(cfg)
    _check_against({k: v for k, v in hf.params.items() if k in want}, want, "params")
    for name, tree in hf.slots.items():
        _check_against({k: v for k, v in tree.items() if k in want}, want, name)
    return hf.only(want)


def tree_to_hf(tree: Mapping[str, Any], cfg: Any) -> dict[str, LazyTensor]:
    """A params tree (flat `layers.q.kernel` -> array or lazy tensor, or the nested dicts) under
    HF names."""
    flat = flatten(tree)
    tensors = {k: v if isinstance(v, LazyTensor) else lazy.ArrayTensor(np.asarray(v)) for k, v in flat.items()}
    return model_rules(cfg).invert().apply_unstack(tensors).tensors


@dataclass(frozen=True)
class SourceNames:
    """Every name decision about one source, made once (`names_of`): named: its tensors and
    slots (under HF names with a config; only the model's with `model_only`); config: the config
    fitted to them; leaf_of / hf_of: source param name -> the tree leaves / HF names it ends under
    (`leaf_namer`), for per-param facts the source records by its own names; hyper: the
    optimizer's hyper-parameters (`OptimizerState.hyper`), each param group's params under the
    source's names, or with `model_only` under the names `named` holds (`exported_hyper`)."""

    named: Named
    config: Any
    leaf_of: Any
    hf_of: Any
    hyper: Mapping[str, Any] = field(default_factory=dict)


def names_of(src: SourceCheckpoint, cfg: Any, *, rules: str | os.PathLike | None = None, strict: bool = True,
             model_only: bool = False) -> SourceNames:
    """`named_for_model` and both `leaf_namer`s of `src` with the same user `rules`; with
    `model_only` (and a config) the named tensors are the model's (`model_hf`: buffers and tied
    copies dropped, every name and shape checked), which is what an export writes."""
    named, cfg = named_for_model(src, cfg, rules=rules, strict=strict)
    user = user_rules(src, cfg, rules) if rules else None
    if model_only and cfg is not None:
        named = model_hf(named, cfg)
    hf_of = leaf_namer(src, cfg, user_rules=user, tree=False)
    hyper = dict(src.optimizer.hyper) if src.optimizer is not None else {}
    if model_only and hyper:
        hyper = exported_hyper(hyper, hf_of, set(named.params))
    return SourceNames(named, cfg, leaf_namer(src, cfg, user_rules=user), hf_of, hyper)


def exported_hyper(hyper: Mapping[str, Any], hf_of, names: set[str]) -> dict:
    """`hyper` with each param group's params under the exported names (`hf_of`: source name ->
    its HF names, the source's names without a config), those not exported (not in `names`) left out."""
    hyper = dict(hyper)
    groups = hyper.pop("groups", None)
    if groups:
        hyper["groups"] = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [h for n in g.get("params") or [] for h in hf_of(str(n)) if h in names]}
            for g in groups
        ]
    return hyper


def leaf_namer(src: SourceCheckpoint, cfg: Any, *, user_rules: RuleSet | None = None, tree: bool = True):
    """`leaf_of(source name) -> [names]`: where a source param ends after the renames an import
    applies (`source_to_hf` then the family's rules: flat tree paths, stacked leaves by their
    base), from the names alone: nothing is read. Without a model config the names stay the
    source's. For per-param facts recorded by source name (optimizer param groups)."""
    from hybridckpt import models

    stages: list[RuleSet] = [user_rules] if user_rules is not None else []
    if cfg is not None:
        variables = {**models.rule_variables(cfg), **dict(src.rule_vars)}
        if src.hf_rules.strip():
            stages.append(parse_rules(src.hf_rules, variables, origin=f"{src.format} rules"))

    def through(names: list[str], rules: RuleSet) -> list[str]:
        out: list[str] = []
        for n in names:
            t = rules.targets_of(n)
            out.extend(t if t is not None else ())
        return out

    fixes_and_model: list[RuleSet] = []
    if cfg is not None:
        hf_names = list(src.tensors)
        for rs in stages:
            hf_names = through(hf_names, rs)
        fixes = models.hf_name_fixes(cfg, hf_names)
        if fixes.strip():
            fixes_and_model.append(parse_rules(fixes, variables, origin="name fixes"))
        fixes_and_model.append(model_rules(cfg) if tree else RuleSet((), (), "none"))

    def leaf_of(name: str) -> list[str]:
        names = [name]
        for rs in stages:
            names = through(names, rs)
        for rs in fixes_and_model[:-1]:  # fixes rename some names and pass the others on
            names = [m for n in names for m in (rs.targets_of(n) or (n,))]
        if fixes_and_model and tree:
            names = through(names, fixes_and_model[-1])
        return names

    return leaf_of
