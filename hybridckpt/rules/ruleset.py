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


@functools.lru_cache(maxsize=4096)  # a rule's target is filled for every key it takes: parse it once
def _template(pattern: str) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    """`pattern` as its literal texts and, between them, its holes: a capture's name, or None
    for a `*` (len(texts) == len(holes) + 1)."""
    texts, holes, pos = [], [], 0
    for m in _CAPTURE.finditer(pattern):
        texts.append(pattern[pos : m.start()])
        holes.append(m.group(1))  # None for "*"
        pos = m.end()
    texts.append(pattern[pos:])
    return tuple(texts), tuple(holes)


def _fill(pattern: str, caps: Mapping[str, str]) -> str:
    """`pattern` with each `$X` replaced by `caps[X]` and the `*`s, in order, by the `_star`
    captures in the order of their names (KeyError / StopIteration when one is missing)."""
    texts, holes = _template(pattern)
    if not holes:
        return pattern
    stars = None
    out = [texts[0]]
    for hole, text in zip(holes, texts[1:], strict=True):
        if hole is None:
            if stars is None:
                stars = iter([v for k, v in sorted(caps.items()) if k.startswith("_star")])
            out.append(next(stars))
        else:
            out.append(caps[hole])
        out.append(text)
    return "".join(out)


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
        split: dict[str, tuple | None] = {}  # name -> split_unstacked(name), once for every rule
        for rule in self.rules:
            src0 = parse_stack(rule.sources[0], rule.where())
            rx = _compile(src0.base)
            others = [parse_stack(s, rule.where()) for s in rule.sources[1:]]
            tgts = [parse_stack(t, rule.where()) for t in rule.targets]
            bases: dict[str, dict | None] = {}  # an expanded name's base -> its captures by `rx`
            hits = 0
            for name in names:
                if name in consumed:
                    continue
                caps = _match(src0, rx, name, split, bases) if src0.stacked else _match(src0, rx, name)
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
        depths = {name: next((d for rx, d in stacked_bases if rx.match(name)), 0) for name in tensors}
        if self._renames_only() and not any("[" in name for name in tensors):
            return self._apply_renames(tensors, depths, strict)
        for name, t in tensors.items():
            if depths[name]:
                for pos, part in unstack(t, depths[name]).items():
                    expanded[unstacked_name(name, pos)] = part
            else:
                expanded[name] = t
        return self.apply(expanded, strict=strict)

    def _renames_only(self) -> bool:
        """Every rule one source, no ops, one plain target (or `_`), and every plain source
        pattern without `*` and `[`: such a pattern never matches an expanded name `base[i]`
        (`$X` matches digits only), so a stacked source alone can take one."""
        for r in self.rules:
            if len(r.sources) != 1 or r.ops or len(r.targets) != 1:
                return False
            if not r.deletes and parse_stack(r.targets[0], r.where()).stacked:
                return False
            src = parse_stack(r.sources[0], r.where())
            if not src.stacked and ("*" in src.base or "[" in src.base):
                return False
        return True

    def _apply_renames(self, tensors: Mapping[str, LazyTensor], depths: dict, strict: bool) -> MappingResult:
        """`apply` of the expanded names of `apply_unstack` (`tensors`, each taken apart on
        `depths[name]` leading axes), for rules that only rename (`_renames_only`) and names
        without `[` (no name can then be another's expanded name): the same result, in the same
        order, a grouped tensor at a time: its base matched once per rule (not once per expanded
        name), its views built together (`lazy.index0_all`)."""
        groups = {name: unstack(t, depths[name]) for name, t in tensors.items() if depths[name]}
        taken: dict[str, set] = {name: set() for name in tensors}  # positions ((): a plain name's) taken
        out: dict[str, LazyTensor] = {}
        unused = []
        for rule in self.rules:
            src = parse_stack(rule.sources[0], rule.where())
            rx = _compile(src.base)
            target = None if rule.deletes else parse_stack(rule.targets[0], rule.where()).base
            hits = 0
            caps_at: dict = {}  # position -> its captures by `src` (the same in every group)
            for name, t in tensors.items():
                parts, done = groups.get(name), taken[name]
                if parts is None:  # a plain name: a plain source may take it
                    m = None if src.stacked or done else rx.match(name)
                    if m is not None:
                        done.add(())
                        hits += 1
                        self._put(out, rule, target, m.groupdict(), t)
                    continue
                if not src.stacked or len(src.indices) != depths[name] or len(done) == len(parts):
                    continue
                m = rx.match(name)
                if m is None:
                    continue
                got = m.groupdict()
                for pos, part in parts.items():
                    if pos in done:
                        continue
                    caps = caps_at.get(pos, caps_at)
                    if caps is caps_at:
                        caps = caps_at[pos] = src.captures(pos)
                    if caps is None:
                        continue
                    done.add(pos)
                    hits += 1
                    self._put(out, rule, target, got | caps, part)
            if hits == 0:
                unused.append(rule)
        unconsumed = []
        for name in tensors:
            parts, done = groups.get(name), taken[name]
            if parts is None:
                unconsumed += [] if done else [name]
            else:
                unconsumed += [unstacked_name(name, pos) for pos in parts if pos not in done]
        if strict and unconsumed:
            shown = ", ".join(repr(k) for k in unconsumed[:20])
            more = f" and {len(unconsumed) - 20} more" if len(unconsumed) > 20 else ""
            raise MappingError(f"{self.origin}: no rule consumes source keys {shown}{more}")
        return MappingResult(out, tuple(unconsumed), tuple(unused))

    @staticmethod
    def _put(out: dict, rule: Rule, target: str | None, caps: dict, x: LazyTensor) -> None:
        if target is None:  # `-> _`: taken, nothing made
            return
        t = _fill(target, caps)
        if t in out:
            raise MappingError(f"{rule.where()}: target {t!r} produced twice")
        out[t] = x


_NOT_YET = object()


def _match(
    spec: StackSpec, rx: re.Pattern, name: str, split: dict | None = None, bases: dict | None = None
) -> dict[str, str] | None:
    """The captures of `name` by a rule's first source (a stacked source matches the expanded
    names `base[i,j]` of `apply_unstack`, its positions giving the index captures). `split`
    (name -> `split_unstacked(name)`) and `bases` (base -> its captures by `rx`, or None) keep
    what one `apply` already worked out: the 256 expanded names of one grouped tensor share
    their base, matched once per rule instead of once per name."""
    if not spec.stacked:
        m = rx.match(name)
        return m.groupdict() if m else None
    parts = _NOT_YET if split is None else split.get(name, _NOT_YET)
    if parts is _NOT_YET:
        parts = split_unstacked(name)
        if split is not None:
            split[name] = parts
    if parts is None or len(parts[1]) != len(spec.indices):
        return None
    got = _NOT_YET if bases is None else bases.get(parts[0], _NOT_YET)
    if got is _NOT_YET:
        m = rx.match(parts[0])
        got = m.groupdict() if m else None
        if bases is not None:
            bases[parts[0]] = got
    caps = spec.captures(parts[1]) if got is not None else None
    return None if caps is None else got | caps


def _fill_spec(spec: StackSpec, caps: Mapping[str, str]) -> str | None:
    """Another source's name from the captures (None: a capture outside an index list)."""
    if not spec.stacked:
        return _fill(spec.base, caps)
    pos = spec.positions(caps)
    return None if pos is None else unstacked_name(_fill(spec.base, caps), pos)
