"""A model's `named_parameters()` order, from its family's parameter table (planning only, no IO).

A torch optimizer built as `AdamW(model.parameters())` (or from the HF Trainer's groups) numbers
the parameters in the order `model.named_parameters()` yields them: a depth-first walk of the
module tree, each module's own parameters first, then its children, each in the order the
module's `__init__` assigned them; a parameter shared by two modules (a tied head) is yielded
once, at its first place. The family declares that order once, as HF names with every number
written `$` (`ParamTable.hf_order()`: `ParamTable.named_parameters`, else the table's rows),
`{var}` filled from its rule variables (Gemma 3's `{text}` prefix).

`named_parameters(cfg, names)` sorts a checkpoint's own parameter names by it: two names compare
by their first differing dotted component, a number by its value (`layers.10` after `layers.9`),
a word by the place of the first declared name that has the same components up to it. That is
the depth-first order whatever the number of layers or experts and whichever optional params
(biases, a head) the config has. A name the declaration does not cover is reported, never
placed by a guess.

This is the one place the order is known: the index-keyed optimizer importers
(`optim.index_names`), Lightning's and the Trainer export use it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.errors import MappingError

NUMBER = "$"  # how a declared name writes a layer / expert number
_VAR = re.compile(r"\{([A-Za-z_]\w*)\}")


@dataclass(frozen=True)
class ParamOrder:
    """The params of a model in `named_parameters()` order.

    names:      HF names, in the order `model.named_parameters()` yields them
    layernorms: those of them that belong to an `nn.LayerNorm` module (the HF Trainer's rule)
    family:     the family whose declaration placed them ("llama")
    """

    names: tuple[str, ...]
    layernorms: frozenset[str]
    family: str


def _declared(cfg: Any) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(family name, its order, its nn.LayerNorm params), `{var}` filled from the rule variables."""
    from hybridckpt import models

    fam = models.family_of(cfg)
    variables = models.rule_variables(cfg)

    def fill(t: str) -> str:
        return _VAR.sub(lambda m: str(variables.get(m.group(1), m.group(0))), t)

    return fam.name, tuple(fill(t) for t in fam.table.hf_order()), tuple(fill(t) for t in fam.table.layernorms)


def declared_order(cfg: Any) -> tuple[str, ...]:
    """`cfg`'s family's declared order (HF names, numbers `$`, `{var}` filled)."""
    return _declared(cfg)[1]


def _pattern(name: str) -> tuple[str, ...]:
    """A name's components with every number written `$`."""
    return tuple(NUMBER if c.isdigit() else c for c in name.split("."))


def _ranks(order: tuple[str, ...]) -> dict[tuple[str, ...], int]:
    """Every prefix of every declared name -> the place of the first declared name having it."""
    first: dict[tuple[str, ...], int] = {}
    for i, t in enumerate(order):
        comps = tuple(t.split("."))
        for d in range(1, len(comps) + 1):
            first.setdefault(comps[:d], i)
    return first


def _key(name: str, ranks: Mapping[tuple[str, ...], int]) -> tuple[int, ...] | None:
    """The sort key of `name` (see the module doc), or None when the declaration lacks it."""
    comps, pattern = name.split("."), _pattern(name)
    if (*pattern,) not in ranks:
        return None
    key: list[int] = []
    for d, c in enumerate(comps):
        key.append(int(c) if c.isdigit() else ranks[pattern[: d + 1]])
    return tuple(key)


def named_parameters(cfg: Any, names: Collection[str]) -> ParamOrder:
    """`names` (the HF names of a model's params) in `cfg`'s family's `named_parameters()` order;
    a MappingError naming those the family's declaration does not place."""
    family, order, layernorms = _declared(cfg)
    ranks = _ranks(order)
    keys = {n: _key(n, ranks) for n in names}
    unknown = sorted(n for n, k in keys.items() if k is None)
    if unknown:
        raise MappingError(
            f"{family}'s named_parameters() order (models/{family}/params.py) does not place {unknown[:3]}"
            f"{f' and {len(unknown) - 3} more' if len(unknown) > 3 else ''}"
        )
    ln_patterns = {tuple(t.split(".")) for t in layernorms}
    return ParamOrder(
        tuple(sorted(names, key=lambda n: keys[n])),
        frozenset(n for n in names if _pattern(n) in ln_patterns),
        family,
    )
