"""A family's dialects: how another framework names and describes the family's checkpoints.

A framework that saves a model under its own names (Megatron's `decoder.layers.N.
self_attention.linear_qkv`, torchtitan's `layers.N.attention.wq`, PaddleNLP's
`llama.layers.N.self_attn.q_proj` `[in, out]`, Meta's `layers.N.attention.wq`) speaks a dialect
of the family. The family owns it, as data in its folder, `models/<family>/dialects/`:

    dialects/__init__.py        (a docstring: the package the registry looks in)
    dialects/<format>.rules     the framework's names -> the family's HF names (rules text)
    dialects/<format>.py        the matcher: which family a framework's own description (Megatron
                                `args`, torchtitan tensor names, Meta `params.json`) is, and
                                what it gives (constants; small functions where data cannot say)

A format (`hybridckpt/formats/`) keeps only its parallel-layout mechanics (TP merges, layer
stacks, expert buckets, offsets) and asks the registry for the rest: `Family.dialect(name)` for
one family, `dialects(name)` for every family that speaks it. Neither names a family. Which
constants each format reads from `<format>.py` is said in that format's reader (and in
docs/dialects.md); a `<format>.py` may also point its rules elsewhere (`RULES`, or `<PART>_RULES`
for a second file, as "package:resource" or a tuple of them, concatenated), so families that
share a framework's names (Qwen2 speaks Llama's PaddleNLP) say so once.

No JAX, nothing of `hybridckpt` above `errors`: a dialect module is imported on first use.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import ModuleType
from typing import Any

from hybridckpt.models.errors import ConfigError

PACKAGE = "dialects"  # the subpackage of a family folder that holds its dialects


@dataclass(frozen=True)
class Dialect:
    """One family's dialect of one framework.

    family:  the family's name ("llama")
    name:    the dialect's name, the files' stem ("megatron", "torchtitan", "paddlenlp", ...)
    package: the family's dialects package ("hybridckpt.models.llama.dialects")
    spec:    the module `<name>.py` (the matcher's constants and functions), None without one
    """

    family: str
    name: str
    package: str
    spec: ModuleType | None

    def get(self, attr: str, default: Any = None) -> Any:
        """The matcher's `attr` (a module constant or function), else `default`."""
        return getattr(self.spec, attr, default) if self.spec is not None else default

    def rules(self, part: str = "") -> tuple[str, str]:
        """(text, origin) of the dialect's rules: `<name>.rules`, or `<name>_<part>.rules` for a
        second file; the matcher's `RULES` / `<PART>_RULES` resources instead when it names
        them. origin reads like "models/llama/dialects/megatron.rules"."""
        attr = f"{part.upper()}_RULES" if part else "RULES"
        own = f"{self.package}:{self.name}{'_' + part if part else ''}.rules"
        refs = self.get(attr, own)
        refs = (refs,) if isinstance(refs, str) else tuple(refs)
        texts, origins = [], []
        for ref in refs:
            package, _, resource = ref.partition(":")
            try:
                texts.append(resources.files(package).joinpath(resource).read_text("utf-8"))
            except (ModuleNotFoundError, FileNotFoundError) as e:
                raise ConfigError(
                    f"{self.package}.{self.name}: rules {ref!r} not found ({e})"
                ) from None
            origins.append(f"{package.replace('.', '/').removeprefix('hybridckpt/')}/{resource}")
        return "\n".join(texts), " + ".join(origins)

    def rules_text(self, part: str = "") -> str:
        """The text of `rules(part)`."""
        return self.rules(part)[0]


def _has(package: str, resource: str) -> bool:
    try:
        return resources.files(package).joinpath(resource).is_file()
    except ModuleNotFoundError:
        return False


@functools.cache
def find(family: str, package: str, name: str) -> Dialect | None:
    """The dialect `name` of the family `family` whose folder is the package `package`: its
    `dialects/<name>.py` and/or `dialects/<name>.rules`; None when the family has neither."""
    pkg = f"{package}.{PACKAGE}"
    try:
        found = resources.files(package).joinpath(PACKAGE).is_dir()
    except ModuleNotFoundError:
        found = False
    if not found or not name.isidentifier():
        return None
    has_spec, has_rules = _has(pkg, f"{name}.py"), _has(pkg, f"{name}.rules")
    if not (has_spec or has_rules):
        return None
    spec = importlib.import_module(f"{pkg}.{name}") if has_spec else None
    return Dialect(family, name, pkg, spec)


def dialects(name: str) -> dict[str, Dialect]:
    """Every family's dialect `name`, by family name (sorted); families without one left out."""
    from hybridckpt.models.family import speaking

    out = {}
    for fam in speaking(name).values():  # (only the families whose folder holds it are imported)
        d = fam.dialect(name)
        if d is not None:
            out[fam.name] = d
    return out


def most_specific(scores: Mapping[str, int | None]) -> list[str]:
    """The families tied at the highest score among those that fit (score not None), sorted:
    one name when one family is the most specific fit, none when no family fits. A format asks
    each family's matcher for a score (how many of its marks the checkpoint shows) and refuses
    an empty or ambiguous answer in its own words."""
    fits = {k: v for k, v in scores.items() if v is not None}
    if not fits:
        return []
    top = max(fits.values())
    return sorted(k for k, v in fits.items() if v == top)
