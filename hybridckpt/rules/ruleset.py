"""Parsed rules and how they apply: `Rule`, `TpRule`, `RuleSet.apply`/`invert`/`apply_unstack`.

A rule's first source pattern is matched against every source name (`$X` captures a decimal
number, `*` any text); its captures fill the other sources and the targets. A target ending in
`[$X]` (or `[$L, $E]`, `[$L in 1,3]`: `hybridckpt.rules.stacking`) collects the matched tensors
into one nested `lazy.Stack` in the order of its indices. Each source key is taken by the first rule that matches it; `MappingResult` reports the
keys no rule took and the rules that matched nothing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules.ops import Op
from hybridckpt.rules.stacking import (
    StackSpec,
    assemble,
    parse_stack,
    split_unstacked,
    unstack,
    unstacked_name,
)
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

    def report(self, *, unused: bool = True) -> list[str]:
        """One line per source key no rule took and, with `unused`, per rule that matched nothing
        (worth saying of a user's rules; the project's own cover variants a checkpoint may lack)."""
        lines = [f"no rule consumes source key {k!r}" for k in self.unconsumed]
        lines += [f"rule matched nothing: {r.where()}" for r in self.unused] if unused else []
        return lines


_CAPTURE = re.compile(r"\$([A-Za-z_]\w*)|\*")


@functools.lru_cache(maxsize=4096)  # a rule's pattern is matched against every key: compile it once
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

    def for_slot(self, slot: str) -> RuleSet:
        """The rules an optimizer slot of the params takes: every op's `Op.for_slot` (layout ops
        as they are, a value op on a param its rescaling of the moment)."""
        rules = tuple(replace(r, ops=tuple(op.for_slot(slot) for op in r.ops)) for r in self.rules)
        return RuleSet(rules, self.tp_rules, f"{self.origin} ({slot})")

    def apply(self, tensors: Mapping[str, LazyTensor], *, strict: bool = True) -> MappingResult:
        """Map `tensors` by the rules. Each source key is taken by the first rule that matches it.

        strict: a source key no rule consumes is a MappingError (listing up to 20 keys).
        """
        consumed: set[str] = set()
        out: dict[str, LazyTensor] = {}
        stacks: dict[str, dict[tuple[int, ...], LazyTensor]] = {}
        stack_rule: dict[str, tuple[Rule, StackSpec]] = {}
        unused = []
        names = list(tensors)
        for rule in self.rules:
            src0 = parse_stack(rule.sources[0], rule.where())
            rx = _compile(src0.base)
            others = [parse_stack(s, rule.where()) for s in rule.sources[1:]]
            tgts = [parse_stack(t, rule.where()) for t in rule.targets]
            hits = 0
            for name in names:
                if name in consumed:
                    continue
                caps = _match(src0, rx, name)
                if caps is None:
                    continue
                srcs = [name] + [_fill_spec(s, caps) for s in others]
                positions = [t.positions(caps) if t.stacked else () for t in tgts]
                if None in srcs or None in positions:
                    continue  # a capture outside an index list: not this rule's key
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
                for spec, pos, x in zip(tgts, positions, xs, strict=True):
                    if spec.stacked:
                        base = _fill(spec.base, caps)
                        slot = stacks.setdefault(base, {})
                        if base in stack_rule and len(stack_rule[base][1].indices) != len(pos):
                            raise MappingError(f"{rule.where()}: {base} is stacked with another depth")
                        if pos in slot:
                            raise MappingError(f"{rule.where()}: {base}{list(pos)} given twice")
                        slot[pos] = x
                        stack_rule.setdefault(base, (rule, spec))
                    else:
                        t = _fill(spec.base, caps)
                        if t in out:
                            raise MappingError(f"{rule.where()}: target {t!r} produced twice")
                        out[t] = x
            if hits == 0:
                unused.append(rule)
        for base, slot in stacks.items():
            rule, spec = stack_rule[base]
            if base in out:
                raise MappingError(f"{rule.where()}: target {base!r} produced twice")
            out[base] = assemble(slot, spec, rule.where(), base)
        unconsumed = tuple(n for n in names if n not in consumed)
        if strict and unconsumed:
            shown = ", ".join(repr(k) for k in unconsumed[:20])
            more = f" and {len(unconsumed) - 20} more" if len(unconsumed) > 20 else ""
            raise MappingError(f"{self.origin}: no rule consumes source keys {shown}{more}")
        return MappingResult(out, unconsumed, tuple(unused))

    def targets_of(self, name: str) -> tuple[str, ...] | None:
        """The target names (stacked targets by their base) the rule consuming `name` produces,
        from the names alone (nothing is read): () for a deleting rule, None when no rule
        matches. A stacked source matches its expanded names `base[i]` and the stacked `base`."""
        for rule in self.rules:
            for text in rule.sources:
                spec = parse_stack(text, rule.where())
                rx = _compile(spec.base)
                caps = _match(spec, rx, name)
                if caps is None and spec.stacked:
                    m = rx.match(name)
                    caps = m.groupdict() if m else None
                if caps is None:
                    continue
                if rule.deletes:
                    return ()
                out = []
                for t in rule.targets:
                    try:
                        out.append(_fill(parse_stack(t, rule.where()).base, caps))
                    except (KeyError, StopIteration):  # a capture only the stack positions give
                        continue
                return tuple(out)
        return None

    def apply_unstack(self, tensors: Mapping[str, LazyTensor], *, strict: bool = True) -> MappingResult:
        """Like `apply`, for rules whose sources are stacked (`name[$L]`, `name[$L, $E]`, e.g.
        inverted rules): each tensor a stacked source's base matches (the base may be a
        pattern, `a.*[$L]`) is first taken apart on as many leading axes as the source has
        indices, into `name[0]`, `name[1]`, ... (`name[0,0]`, `name[0,1]`, ...)."""
        expanded: dict[str, LazyTensor] = {}
        stacked_bases = []
        for r in self.rules:
            for s in r.sources:
                spec = parse_stack(s, r.where())
                if spec.stacked:
                    stacked_bases.append((_compile(spec.base), len(spec.indices)))
        for name, t in tensors.items():
            depth = next((d for rx, d in stacked_bases if rx.match(name)), 0)
            if depth:
                for pos, part in unstack(t, depth).items():
                    expanded[unstacked_name(name, pos)] = part
            else:
                expanded[name] = t
        return self.apply(expanded, strict=strict)


def _match(spec: StackSpec, rx: re.Pattern, name: str) -> dict[str, str] | None:
    """The captures of `name` by a rule's first source (a stacked source matches the expanded
    names `base[i,j]` of `apply_unstack`, its positions giving the index captures)."""
    if not spec.stacked:
        m = rx.match(name)
        return m.groupdict() if m else None
    parts = split_unstacked(name)
    if parts is None or len(parts[1]) != len(spec.indices):
        return None
    m = rx.match(parts[0])
    caps = spec.captures(parts[1]) if m else None
    return None if caps is None else m.groupdict() | caps


def _fill_spec(spec: StackSpec, caps: Mapping[str, str]) -> str | None:
    """Another source's name from the captures (None: a capture outside an index list)."""
    if not spec.stacked:
        return _fill(spec.base, caps)
    pos = spec.positions(caps)
    return None if pos is None else unstacked_name(_fill(spec.base, caps), pos)
