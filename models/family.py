"""A model family as one record, and the registry that finds every family by itself.

A family is a subpackage `models/<name>/` whose `__init__.py` defines `FAMILY = Family(...)`.
`families()` imports each subpackage of `models` (pkgutil over `models.__path__`, once) and keeps
those that define `FAMILY`, so adding a family is adding a folder; nothing else names it. The
lookups a job makes of one family import only the folders they can be in: `family_for_hf` the
folder named as the config's `model_type` first, `family_of` the config class's own folder,
`dialects(name)` the folders holding that dialect (`speaking`); each falls back to every family.

What a family gives (JAX-free unless said):
- `config_cls`: its frozen config dataclass; `family_of(cfg)` goes by the config's type.
- `hf_architectures` / `hf_model_types`: the HF `config.json` `architectures` entries and
  `model_type` values it reads; `config_from_hf(d, source)` / `config_to_hf(cfg)` convert.
- `table`: its `models.table.ParamTable`, the one declaration of its params (path, shape,
  logical axes, HF name and layout op, condition): the shape tree, the logical axes, the HF rules
  and the params its Flax module creates all come from it (`specs`, `shape_tree`, `axes_tree`,
  `hf_rules`), without JAX.
- `rule_variables(cfg)`: the variables its rules may use; at least `RULE_VARIABLES`.
- `module`: "pkg.mod:Class", the Flax module `Class(cfg, compute_dtype)`, imported on first use
  (`flax_module()`), so configs and shapes never import JAX; it creates its params from the
  table (`models.common.table_param`).
- `config_from_meta(d, vocab_size, source)`: only for families Meta's `params.json` describes.
- `hf_name_fixes(names)`: a rules text renaming alternate HF spellings of the tensor `names`
  to the canonical ones the family's rules expect ("" when there are none).
- `fit_to_hf_names(cfg, names)`: the config of the checkpoint whose HF tensor names are `names`
  (default: `cfg`); DeepSeek V3 counts the MTP modules a checkpoint carries.

A family's dialects (how Megatron, torchtitan, PaddleNLP, Meta... name and describe it) are files
in its folder, `models/<family>/dialects/`, found by `Family.dialect(name)` (`models.dialect`);
no field declares them.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from hybridckpt.models.errors import ConfigError, UnknownModelError
from hybridckpt.models.table import ParamTable, Spec, axes_tree, groups_tree, shape_tree


class ModelConfig(Protocol):
    """What every family's config offers: a frozen, hashable dataclass with these at least."""

    vocab_size: int

    @property
    def family(self) -> str:
        """The family's name (our JSON's "family")."""

    @property
    def num_layers(self) -> int:
        """The number of transformer blocks (the leading `[L]` axis of stacked params)."""


# Keys every family's `rule_variables` gives (rules of formats and users may rely on them).
RULE_VARIABLES = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "num_layers",
    "intermediate_size",
    "tied",
)


def no_name_fixes(names: Collection[str]) -> str:
    """The default `hf_name_fixes`: HF files of the family use one spelling only."""
    return ""


def same_config(cfg: Any, names: Collection[str]) -> Any:
    """The default `fit_to_hf_names`: the config alone says which tensors there are."""
    return cfg


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring for what each field means)."""

    name: str
    config_cls: type
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any], str], Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    table: ParamTable
    rule_variables: Callable[[Any], dict[str, Any]]
    module: str
    config_from_meta: Callable[[Mapping[str, Any], int | None, str], Any] | None = None
    hf_name_fixes: Callable[[Collection[str]], str] = no_name_fixes
    fit_to_hf_names: Callable[[Any, Collection[str]], Any] = same_config

    def flax_module(self) -> type:
        """The Flax module class named by `module` (imports JAX and Flax)."""
        path, _, attr = self.module.partition(":")
        return getattr(importlib.import_module(path), attr)

    def specs(self, cfg: Any) -> dict[str, Spec]:
        """The params of `cfg`: flat path -> shape, logical axes, init (`ParamTable.specs`)."""
        return self.table.specs(cfg, self.rule_variables(cfg))

    def shape_tree(self, cfg: Any) -> dict:
        """Nested dicts of fp32 param shape tuples: kernels `[in, out]`, per-layer params
        stacked on a leading `[L]` axis (the tree the Flax module's init builds)."""
        return shape_tree(self.specs(cfg))

    def axes_tree(self, cfg: Any) -> dict:
        """Nested dicts (the `shape_tree` structure) of logical-axis tuples."""
        return axes_tree(self.specs(cfg))

    def groups_tree(self, cfg: Any) -> dict:
        """Nested dicts (the `shape_tree` structure) of per-dim `Groups` (heads, experts) or None."""
        return groups_tree(self.specs(cfg))

    def hf_rules(self) -> tuple[str, str]:
        """(text, origin) of the rules from HF names to the params tree, generated from the
        table; origin reads like "models/llama/params.py table" (line N is row N)."""
        return self.table.rules_text(), self.table.rules_origin

    def dialect(self, name: str):
        """The family's dialect `name` (`models.dialect.Dialect`: its rules and matcher, from
        `models/<family>/dialects/<name>.{rules,py}`), or None when the family has none."""
        from hybridckpt.models import dialect

        if self.name not in _PACKAGES:
            _discover()
        package = _PACKAGES.get(self.name)
        return None if package is None else dialect.find(self.name, package, name)


# -------------------------------------------------------------------------------- registry


def _check_unique(found: dict[str, Family], fam: Family, where: str) -> None:
    for other in found.values():
        clashes = [
            ("name", {fam.name} & {other.name}),
            ("config_cls", {fam.config_cls} & {other.config_cls}),
            ("hf_architectures", set(fam.hf_architectures) & set(other.hf_architectures)),
            ("hf_model_types", set(fam.hf_model_types) & set(other.hf_model_types)),
        ]
        for field, common in clashes:
            if common:
                raise ConfigError(
                    f"{where}: family {fam.name!r} repeats {field} {sorted(map(str, common))} "
                    f"of family {other.name!r}"
                )


# family name -> the package (folder) that defines it, where its dialects are looked up
_PACKAGES: dict[str, str] = {}


@functools.cache
def _folders() -> dict[str, str]:
    """The subpackages of `models`, name -> folder (a listing of its folder: nothing imported)."""
    package = importlib.import_module(__package__)
    return {info.name: os.path.join(info.module_finder.path, info.name.rpartition(".")[2])
            for info in pkgutil.iter_modules(package.__path__, prefix=f"{__package__}.") if info.ispkg}


def _subpackages() -> tuple[str, ...]:
    """The names of the subpackages of `models`, in the order `pkgutil` lists them."""
    return tuple(_folders())


def _family_in(package: str) -> Family | None:
    """The `FAMILY` of the subpackage `package` (imported), or None when it defines none."""
    fam = getattr(importlib.import_module(package), "FAMILY", None)
    if fam is None:
        return None
    if not isinstance(fam, Family):
        raise ConfigError(f"{package}.FAMILY: expected a Family, found {type(fam).__name__}")
    _PACKAGES[fam.name] = package
    return fam


@functools.cache
def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for name in _subpackages():
        fam = _family_in(name)
        if fam is None:
            continue
        _check_unique(found, fam, f"{name}.FAMILY")
        found[fam.name] = fam
    return dict(sorted(found.items()))


def _named_package(name: Any) -> Family | None:
    """The family of the subpackage called `name` (an HF `model_type`, a config's module), imported
    alone, or None when no subpackage has that name or it defines no family. A job that needs one
    family (an import of a Llama) imports its package only, not the 27 of them (about 0.1 s of
    CPU, most of the time an import spent in `open` besides the other formats' readers). Which
    family a config is stays what `_discover` would say: a field of a family is unique among
    all (`_check_unique`, tests/models run it), so the family found here is the only one."""
    if not isinstance(name, str) or f"{__package__}.{name}" not in _subpackages():
        return None  # (a name from a file picks among our folders only, never an import path)
    package = f"{__package__}.{name}"
    if _discover.cache_info().currsize:  # every family found already: that registry answers
        return next((f for f in _discover().values() if _PACKAGES.get(f.name) == package), None)
    return _family_in(package)


def speaking(dialect: str) -> dict[str, Family]:
    """The families whose folder holds the dialect `dialect` (`dialects/<dialect>.py` or `.rules`,
    `models.dialect`), by name (sorted): only their packages are imported (a DCP source asks for
    torchtitan's: 4 of the 27 families)."""
    found: dict[str, Family] = {}
    if not dialect.isidentifier():
        return found
    for package, folder in _folders().items():
        if any(os.path.isfile(os.path.join(folder, "dialects", dialect + ext)) for ext in (".py", ".rules")):
            fam = _family_in(package)
            if fam is not None:
                found[fam.name] = fam
    return dict(sorted(found.items()))


def families() -> dict[str, Family]:
    """Every family found under `models/`, by name (sorted)."""
    return dict(_discover())


def family_of(cfg: Any) -> Family:
    """The family whose `config_cls` is `cfg`'s type (or a base of it)."""
    module = type(cfg).__module__.split(".")
    if module[:2] == __package__.split(".") and len(module) > 2:  # its own folder's family first
        fam = _named_package(module[2])
        if fam is not None and type(cfg) is fam.config_cls:  # (what the walk below finds first)
            return fam
    by_cls = {fam.config_cls: fam for fam in _discover().values()}
    for cls in type(cfg).__mro__:
        if cls in by_cls:
            return by_cls[cls]
    known = ", ".join(fam.config_cls.__name__ for fam in _discover().values())
    raise ConfigError(f"expected a model config ({known}), found {type(cfg).__name__}")


def family_named(name: Any, what: str = "model config") -> Family:
    """The family called `name` (our JSON's "family"); `what` names the source in errors."""
    fam = _discover().get(name) if isinstance(name, str) else None
    if fam is None:
        raise ConfigError(
            f"{what}: family {name!r} is unknown; expected one of {sorted(_discover())}"
        )
    return fam


def supported_hf() -> str:
    """The HF architectures and model types read, as error messages list them."""
    fams = _discover().values()
    archs = ", ".join(a for fam in fams for a in fam.hf_architectures)
    types = ", ".join(t for fam in fams for t in fam.hf_model_types)
    return f"architectures {archs} (model_type {types})"


def family_for_hf(d: Mapping[str, Any], source: str) -> Family:
    """The family of an HF config dict: by its `architectures`, else (none given) `model_type`."""
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    guess = _named_package(d.get("model_type"))  # the folder named as its model_type, alone
    if guess is not None and (next(iter(archs)) in guess.hf_architectures if archs  # (the first decides, as below)
                              else d.get("model_type") in guess.hf_model_types):
        return guess
    for arch in archs:
        for fam in _discover().values():
            if arch in fam.hf_architectures:
                return fam
    if archs:
        raise UnknownModelError(
            f"{source}: architectures {list(archs)} (model_type {d.get('model_type')!r}) is not "
            f"supported; supported: {supported_hf()}"
        )
    model_type = d.get("model_type")
    for fam in _discover().values():
        if model_type in fam.hf_model_types:
            return fam
    raise UnknownModelError(
        f"{source}: model_type {model_type!r} with no architectures is not supported; "
        f"supported: {supported_hf()}"
    )
