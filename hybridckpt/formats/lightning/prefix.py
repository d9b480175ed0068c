"""The LightningModule's attribute prefix: what stands before the model's own names.

A LightningModule holds the model as an attribute (`self.model = LlamaForCausalLM(...)`), so its
`state_dict()` names are `<attribute>.<HF name>`: `model.model.embed_tokens.weight`,
`model.lm_head.weight`. HF's own names may start with the same word (Llama's `model.`), so the
prefix is not "everything up to the first dot": it is the one dotted prefix, common to every
name, that makes every name one the model family knows.

- With a model config (`--config`, or a `config.json` beside the checkpoint): every dotted
  prefix common to all names is tried, longest first ("" included); a prefix fits when every
  name it leaves, after the family's alternate-spelling fixes (`models.hf_name_fixes`), is
  consumed by a rule of the family's table (`models.hf_rules`, `RuleSet.targets_of`: names only,
  nothing read). Exactly one fitting prefix, or several that give the same HF names (GPT-2's
  bare `h.0...` is `transformer.h.0...` after its fixes), is taken; none or several that give
  different names is one FormatError listing the candidates.
- Without a config: the longest common prefix that leaves every name a dotted path of two parts
  at least (`lm_head.weight`, never a bare `weight`), said in a note, since only the family can
  tell an attribute from a first HF component.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridckpt.errors import FormatError, HybridCkptError, short_repr

MAX_SHOWN = 4  # candidates an error names


@dataclass(frozen=True)
class Prefix:
    """The attribute prefix taken (`""`: none) and how it was decided (a note for `inspect`)."""

    prefix: str
    note: str


def candidates(names: Iterable[str]) -> list[str]:
    """Every dotted prefix (`a.`, `a.b.`) all of `names` start with, longest first, then "";
    never one that would leave a name without its last dotted part."""
    common: list[str] | None = None
    shortest = None
    for name in names:
        parts = name.split(".")
        shortest = len(parts) if shortest is None else min(shortest, len(parts))
        if common is None:
            common = parts[:-1]
            continue
        k = 0
        while k < len(common) and k < len(parts) - 1 and common[k] == parts[k]:
            k += 1
        del common[k:]
    common = common or []
    return [".".join(common[:i]) + "." for i in range(len(common), 0, -1)] + [""]


def strip(names: Iterable[str], prefix: str) -> list[str]:
    return [n[len(prefix):] for n in names]


def family_fit(cfg: Any) -> Callable[[Sequence[str]], tuple[str, ...] | None]:
    """`fit(names)`: the HF names `names` are for the model family of `cfg` (after its name
    fixes), or None when some name is not one the family's rules consume."""
    from hybridckpt import models
    from hybridckpt.rules import parse_rules

    variables = models.rule_variables(cfg)
    text, origin = models.hf_rules(cfg)
    rules = parse_rules(text, variables, origin=origin)

    def fit(names: Sequence[str]) -> tuple[str, ...] | None:
        fixed = list(names)
        try:
            fixes = models.hf_name_fixes(cfg, fixed)
            if fixes.strip():
                fix_rules = parse_rules(fixes, variables, origin="name fixes")
                out = []
                for n in fixed:
                    t = fix_rules.targets_of(n)
                    out += [n] if t is None else list(t)
                fixed = out
            if any(rules.targets_of(n) is None for n in fixed):
                return None
        except HybridCkptError:
            return None
        return tuple(sorted(fixed))

    return fit


def choose(names: Sequence[str], fit: Callable[[Sequence[str]], tuple[str, ...] | None] | None, where: str,
           family: str = "the model") -> Prefix:
    """The attribute prefix of `names` (module doc): by `fit` (the family's, `family_fit`) when
    a config is known, else the longest common one that leaves `a.b` names."""
    if not names:
        raise FormatError(f"{where}: the state dict holds no tensors")
    cands = candidates(names)
    if fit is None:
        for p in cands:
            if all("." in n for n in strip(names, p)):
                if not p:
                    return Prefix("", "Lightning state dict: no attribute prefix common to every name; names kept")
                return Prefix(p, f"Lightning state dict: the longest common prefix {p!r} taken as the LightningModule's "
                                 f"attribute (no model config to match names against: pass --config)")
        return Prefix("", "Lightning state dict: names kept")
    fitting: dict[str, tuple[str, ...]] = {}
    for p in cands:
        got = fit(strip(names, p))
        if got is not None:
            fitting[p] = got
    if len(set(fitting.values())) == 1:
        p = max(fitting, key=len)
        shown = "no attribute prefix" if not p else f"the attribute prefix {p!r}"
        return Prefix(p, f"Lightning state dict: {shown} makes every name a {family} HF name")
    tried = ", ".join(f"{p!r} -> {short_repr(names[0][len(p):], 60)}" for p in cands[:MAX_SHOWN])
    if not fitting:
        raise FormatError(
            f"{where}: no attribute prefix of the LightningModule's names makes them all {family} HF names "
            f"(tried {tried}); pass the checkpoint's own config (--config), or read it as it is (--format torch, or dcp "
            f"for a sharded folder) with --rules to rename"
        )
    both = ", ".join(repr(p) for p in list(fitting)[:MAX_SHOWN])
    raise FormatError(
        f"{where}: the LightningModule's names fit the {family} model under several attribute prefixes ({both}), "
        f"which give different HF names; read it as it is (--format torch, or dcp for a sharded folder) with --rules "
        f"to rename"
    )


def strip_mapping(d: Mapping[str, Any], prefix: str, where: str, what: str) -> dict[str, Any]:
    """`d` with `prefix` cut from every key; a key without it is a FormatError naming it."""
    out = {}
    for k, v in d.items():
        if not (isinstance(k, str) and k.startswith(prefix)):
            raise FormatError(f"{where}: {what} {short_repr(k)} is not under the attribute prefix {prefix!r} of the "
                              f"model's tensors")
        out[k[len(prefix):]] = v
    return out
