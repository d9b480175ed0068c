"""Parsed rules and how they apply: `Rule`, `TpRule`, `RuleSet.apply`/`invert`/`apply_unstack`.

A rule's first source pattern is matched against every source name (`$X` captures a decimal
number, `*` any text); its captures fill the other sources and the targets. A target ending in
`[$X]` collects the matched tensors into one `lazy.Stack` in the order of `$X`, which must run
0..n-1. Each source key is taken by the first rule that matches it; `MappingResult` reports the
keys no rule took and the rules that matched nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules.ops import Op
from hybridckpt.rules.tp import merge_tp


@dataclass(frozen=True)
class Rule:
    """`sources -> targets : ops`; `line` and `text` point back at the rules text."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    ops: tuple[Op, ...]
    line: int = 0
    text: str = ""
    origin: str = "<rules>"

    @property
    def deletes(self) -> bool:
        return self.targets == ("_",)

    def where(self) -> str:
        return f"{self.origin}:{self.line}: {self.text}"


@dataclass(frozen=True)
class TpRule:
    pattern: str
    merge: Op
    line: int = 0
    text: str = ""


@dataclass(frozen=True)
class MappingResult:
    """`tensors`: target name -> tensor; `unconsumed`: source names no rule took;
    `unused`: rules that matched nothing."""

    tensors: dict[str, LazyTensor]
    unconsumed: tuple[str, ...]
    unused: tuple[Rule, ...]

    def report(self) -> list[str]:
        lines = [f"no rule consumes source key {k!r}" for k in self.unconsumed]
        lines += [f"rule matched nothing: {r.where()}" for r in self.unused]
        return lines


_CAPTURE = re.compile(r"\$([A-Za-z_]\w*)|\*")
_STACK = re.compile(r"^(?P<base>.*)\[\$(?P<var>[A-Za-z_]\w*)\]$")


def _compile(pattern: str) -> re.Pattern:
    out, pos, stars = [], 0, 0
    for m in _CAPTURE.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        if m.group(0) == "*":
            out.append(f"(?P<_star{stars}>.+?)")
            stars += 1
        else:
            out.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("^" + "".join(out) + "$")


def _fill(pattern: str, caps: Mapping[str, str]) -> str:
    stars = iter(v for k, v in sorted(caps.items()) if k.startswith("_star"))

    def sub(m: re.Match) -> str:
        if m.group(0) == "*":
            return next(stars)
        return caps[m.group(1)]

    return _CAPTURE.sub(sub, pattern)


@dataclass(frozen=True)
class RuleSet:
    """Parsed rules; `apply` maps tensors, `invert` gives the rules of the other direction."""

    rules: tuple[Rule, ...]
    tp_rules: tuple[TpRule, ...] = ()
    origin: str = "<rules>"
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def __add__(self, other: RuleSet) -> RuleSet:
        return RuleSet(self.rules + other.rules, self.tp_rules + other.tp_rules, self.origin)

    def tp_merge_for(self, name: str) -> TpRule:
        for r in self.tp_rules:
            if _compile(r.pattern).match(name):
                return r
        raise MappingError(f"{self.origin}: no tp rule says how to merge shards of {name!r}")

    def merge_tp(self, name: str, shards: Sequence[LazyTensor]) -> LazyTensor:
        if len(shards) == 1:
            return shards[0]
        rule = self.tp_merge_for(name)
        return merge_tp(shards, rule.merge, where=f"{name} (tp rule line {rule.line}: {rule.text})")

    def invert(self) -> RuleSet:
        """Rules of the opposite direction: targets become sources, ops inverted in reverse order."""
        inv = []
        for r in self.rules:
            if r.deletes:
                continue
            ops = tuple(op.inverse() for op in reversed(r.ops))
            inv.append(Rule(r.targets, r.sources, ops, r.line, f"inverse of: {r.text}", r.origin))
        return RuleSet(tuple(inv), (), f"inverse of {self.origin}")

    def apply(self, tensors: Mapping[str, LazyTensor], *, strict: bool = True) -> MappingResult:
        """Map `tensors` by the rules. Each source key is taken by the first rule that matches it.

        strict: a source key no rule consumes is a MappingError (listing up to 20 keys).
        """
        consumed: set[str] = set()
        out: dict[str, LazyTensor] = {}
        stacks: dict[str, dict[int, LazyTensor]] = {}
        stack_rule: dict[str, Rule] = {}
        unused = []
        names = list(tensors)
        for rule in self.rules:
            rx = _compile(rule.sources[0])
            hits = 0
            for name in names:
                if name in consumed:
                    continue
                m = rx.match(name)
                if not m:
                    continue
                caps = m.groupdict()
                srcs = [name] + [_fill(s, caps) for s in rule.sources[1:]]
                missing = [s for s in srcs if s not in tensors]
                if missing:
                    raise MappingError(
                        f"{rule.where()}: {name!r} matched but {missing} are missing from the source"
                    )
                if any(s in consumed for s in srcs):
                    continue
                hits += 1
                consumed.update(srcs)
                if rule.deletes:
                    continue
                xs = [tensors[s] for s in srcs]
                for i, op in enumerate(rule.ops):
                    if op.name == "split" and len(op.args) == 1 and i == len(rule.ops) - 1:
                        # `split(axis)` as a rule's last op: as many equal parts as targets
                        # (the inverse of a `concat(axis)` written without sizes)
                        op = Op("split", (op.args[0], len(rule.targets)))
                    xs = op.apply(xs, f"{rule.where()} (on {name!r})")
                if len(xs) != len(rule.targets):
                    raise MappingError(
                        f"{rule.where()}: ops give {len(xs)} tensors for {len(rule.targets)} targets"
                    )
                for tgt, x in zip(rule.targets, xs, strict=True):
                    sm = _STACK.match(tgt)
                    if sm:
                        base = _fill(sm.group("base"), caps)
                        idx = int(caps[sm.group("var")])
                        slot = stacks.setdefault(base, {})
                        if idx in slot:
                            raise MappingError(f"{rule.where()}: {base}[{idx}] given twice")
                        slot[idx] = x
                        stack_rule[base] = rule
                    else:
                        t = _fill(tgt, caps)
                        if t in out:
                            raise MappingError(f"{rule.where()}: target {t!r} produced twice")
                        out[t] = x
            if hits == 0:
                unused.append(rule)
        for base, slot in stacks.items():
            n = max(slot) + 1
            if sorted(slot) != list(range(n)):
                missing = sorted(set(range(n)) - set(slot))
                raise MappingError(
                    f"{stack_rule[base].where()}: cannot stack {base}: indices {missing} are missing"
                )
            if base in out:
                raise MappingError(f"{stack_rule[base].where()}: target {base!r} produced twice")
            out[base] = lazy.Stack(tuple(slot[i] for i in range(n)))
        unconsumed = tuple(n for n in names if n not in consumed)
        if strict and unconsumed:
            shown = ", ".join(repr(k) for k in unconsumed[:20])
            more = f" and {len(unconsumed) - 20} more" if len(unconsumed) > 20 else ""
            raise MappingError(f"{self.origin}: no rule consumes source keys {shown}{more}")
        return MappingResult(out, unconsumed, tuple(unused))

    def apply_unstack(self, tensors: Mapping[str, LazyTensor], *, strict: bool = True) -> MappingResult:
        """Like `apply`, for rules whose sources are stacked (`name[$L]`, e.g. inverted rules):
        each tensor a stacked source's base matches (the base may be a pattern, `a.*[$L]`) is
        first split into `name[0]`, `name[1]`, ... along its leading axis."""
        expanded: dict[str, LazyTensor] = {}
        stacked_bases = [
            _compile(_STACK.match(s).group("base"))
            for r in self.rules
            for s in r.sources
            if _STACK.match(s)
        ]
        for name, t in tensors.items():
            if any(rx.match(name) for rx in stacked_bases):
                for i in range(t.shape[0]):
                    expanded[f"{name}[{i}]"] = lazy.index0(t, i)
            else:
                expanded[name] = t
        return self.apply(expanded, strict=strict)
