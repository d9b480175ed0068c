"""The mapping language: declarative, invertible rules for every name and layout change.

A rules text has one statement per line; `#` starts a comment. `{var}` is replaced by a variable
(from the model config or the source's topology) before parsing.

Rename/layout rules, applied to a dict of global tensors::

    SOURCE[, SOURCE...] -> TARGET[, TARGET...] [: op, op, ...] [when [not] VAR]
    SOURCE -> _                                    # delete: consumed, not carried over

Patterns: `$X` captures a decimal number (a layer index); `*` captures any text. The captures of
the first source fill the other sources and the targets. A target may end with `[$X]`: the
matched tensors are stacked on a new leading axis in the order of `$X`, which must run 0..n-1.

Ops, in order from source to target; each has an exact inverse, so an export is derived by
`RuleSet.invert()` and never written twice:

    transpose | transpose(p0, p1, ...)   axes permutation            <-> its inverse permutation
    unflatten(axis, s0, s1, ...)         split one axis (one -1 ok)  <-> flatten(axis, s0, s1, ...)
    split(axis, n) | split(axis, s0, s1, ...)   one -> many          <-> concat(axis, ...)
    split(axis)                          as the last op: one equal part per target
    fused_qkv(axis, heads, kv_heads)     one -> q, k, v; per kv group `[heads/kv_heads q | k | v]`
                                         head blocks along `axis`     <-> unfused_qkv(...)
    rope_permute(heads)                  rows of `[heads*head_dim, ...]` from interleaved (Meta)
                                         pairs to half-split (HF)     <-> rope_unpermute(heads)
    trim(axis, size[, padded])           keep the first `size` (vocab padding) <-> pad with zeros
                                         to `padded` (an error without `padded`)
    cast(dtype[, from_dtype])            another dtype               <-> cast(from_dtype) or none

Tensor-parallel merge rules, used by per-rank formats to join the shards of one tensor::

    tp PATTERN : concat(axis) | halves(axis) | replicated [when [not] VAR]

`halves(axis)`: every shard holds `[first_r | second_r]` (SwiGLU fc1, fused gate_up): the result
is `[first_0 .. first_n | second_0 .. second_n]`. `replicated`: every shard holds the whole
tensor; shard 0 is used. The first matching `tp` rule wins.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor

# -- ops -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One layout op: `name(args)`; `apply` maps a list of tensors to a list of tensors."""

    name: str
    args: tuple = ()

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})" if self.args else self.name

    def apply(self, xs: list[LazyTensor], where: str) -> list[LazyTensor]:
        fn = _OPS.get(self.name)
        if fn is None:
            raise MappingError(f"{where}: unknown op {self.name!r}")
        try:
            return fn(xs, *self.args)
        except MappingError as e:
            raise MappingError(f"{where}: {self}: {e}") from None
        except (ValueError, IndexError, TypeError, ZeroDivisionError) as e:
            shapes = [x.shape for x in xs]
            raise MappingError(f"{where}: {self} does not apply to shapes {shapes}: {e}") from None

    def inverse(self) -> Op:
        inv = _INVERSE.get(self.name)
        if inv is None:
            raise MappingError(f"op {self} has no inverse")
        return inv(self)


def _one(xs: list[LazyTensor], op: str) -> LazyTensor:
    if len(xs) != 1:
        raise MappingError(f"{op} takes one tensor, got {len(xs)}")
    return xs[0]


def _op_transpose(xs, *perm):
    x = _one(xs, "transpose")
    return [lazy.transpose(x, perm or None)]


def _op_unflatten(xs, axis, *sizes):
    x = _one(xs, "unflatten")
    axis %= x.ndim
    sizes = list(sizes)
    if sizes.count(-1) > 1:
        raise MappingError("unflatten takes at most one -1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = x.shape[axis] // known
    if math.prod(sizes) != x.shape[axis]:
        raise MappingError(f"axis {axis} of size {x.shape[axis]} is not {sizes}")
    return [lazy.reshape(x, x.shape[:axis] + tuple(sizes) + x.shape[axis + 1 :])]


def _op_flatten(xs, axis, *sizes):
    x = _one(xs, "flatten")
    axis %= x.ndim
    n = len(sizes)
    return [lazy.reshape(x, x.shape[:axis] + (-1,) + x.shape[axis + n :])]


def _op_split(xs, axis, *sizes):
    x = _one(xs, "split")
    axis %= x.ndim
    if not sizes:
        raise MappingError("split needs a count or sizes")
    if len(sizes) == 1:
        n = sizes[0]
        if x.shape[axis] % n:
            raise MappingError(f"axis {axis} of size {x.shape[axis]} does not split in {n}")
        sizes = (x.shape[axis] // n,) * n
    return lazy.split(x, axis, sizes)


def _op_concat(xs, axis, *sizes):
    if sizes and [x.shape[axis % x.ndim] for x in xs] != list(sizes):
        raise MappingError(f"parts of sizes {[x.shape[axis] for x in xs]} are not {list(sizes)}")
    return [lazy.concat(xs, axis)]


def _qkv_layout(total: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """(query heads per group, head_dim) of a fused qkv axis of `total` rows."""
    if heads % kv_heads:
        raise MappingError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    group = heads // kv_heads
    per = kv_heads * (group + 2)
    if total % per:
        raise MappingError(f"fused qkv size {total} is not a multiple of {per} head blocks")
    return group, total // per


def _op_fused_qkv(xs, axis, heads, kv_heads):
    x = _one(xs, "fused_qkv")
    axis %= x.ndim
    group, hd = _qkv_layout(x.shape[axis], heads, kv_heads)
    block = (group + 2) * hd
    qs, ks, vs = [], [], []
    for g in range(kv_heads):
        base = g * block
        qs.append(lazy.slice_axis(x, axis, base, base + group * hd))
        ks.append(lazy.slice_axis(x, axis, base + group * hd, base + (group + 1) * hd))
        vs.append(lazy.slice_axis(x, axis, base + (group + 1) * hd, base + block))
    return [lazy.concat(qs, axis), lazy.concat(ks, axis), lazy.concat(vs, axis)]


def _op_unfused_qkv(xs, axis, heads, kv_heads):
    if len(xs) != 3:
        raise MappingError(f"unfused_qkv takes q, k, v, got {len(xs)} tensors")
    q, k, v = xs
    axis %= q.ndim
    group = heads // kv_heads
    hd = k.shape[axis] // kv_heads
    if q.shape[axis] != heads * hd or v.shape[axis] != kv_heads * hd:
        raise MappingError(f"q/k/v sizes {q.shape}, {k.shape}, {v.shape} do not fit {heads}/{kv_heads} heads")
    parts = []
    for g in range(kv_heads):
        parts.append(lazy.slice_axis(q, axis, g * group * hd, (g + 1) * group * hd))
        parts.append(lazy.slice_axis(k, axis, g * hd, (g + 1) * hd))
        parts.append(lazy.slice_axis(v, axis, g * hd, (g + 1) * hd))
    return [lazy.concat(parts, axis)]


def rope_permutation(rows: int, heads: int) -> np.ndarray:
    """Row order taking interleaved RoPE pairs (Meta) to half-split (HF), per head.

    HF's permute: `w.view(heads, hd/2, 2, dim).transpose(1, 2).reshape(heads*hd, dim)`
    (huggingface/transformers:src/transformers/models/llama/convert_llama_weights_to_hf.py):
    output row (h, j, i) is input row (h, i, j) for j in {0, 1}, i < hd/2.
    """
    if rows % heads or (rows // heads) % 2:
        raise MappingError(f"{rows} rows do not form {heads} heads of even head_dim")
    hd = rows // heads
    idx = np.arange(rows).reshape(heads, hd // 2, 2).transpose(0, 2, 1).reshape(-1)
    return idx


def _op_rope_permute(xs, heads):
    x = _one(xs, "rope_permute")
    return [lazy.Take(x, 0, tuple(int(i) for i in rope_permutation(x.shape[0], heads)))]


def _op_rope_unpermute(xs, heads):
    x = _one(xs, "rope_unpermute")
    inv = np.argsort(rope_permutation(x.shape[0], heads))
    return [lazy.Take(x, 0, tuple(int(i) for i in inv))]


def _op_trim(xs, axis, size, padded=None):
    x = _one(xs, "trim")
    if size > x.shape[axis % x.ndim]:
        raise MappingError(f"cannot trim axis {axis} of size {x.shape[axis]} to {size}")
    return [lazy.slice_axis(x, axis, 0, size)]


def _op_pad(xs, axis, padded):
    x = _one(xs, "pad")
    axis %= x.ndim
    extra = padded - x.shape[axis]
    if extra < 0:
        raise MappingError(f"cannot pad axis {axis} of size {x.shape[axis]} to {padded}")
    if extra == 0:
        return [x]
    shape = list(x.shape)
    shape[axis] = extra
    return [lazy.concat([x, lazy.ArrayTensor(np.zeros(shape, dtype=x.dtype))], axis)]


def _op_cast(xs, dtype, from_dtype=None):
    x = _one(xs, "cast")
    return [lazy.cast(x, _dtype(dtype))]


def _op_identity(xs, *args):
    return list(xs)


def _dtype(name) -> np.dtype:
    import ml_dtypes

    if str(name) == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(str(name))
    except TypeError:
        raise MappingError(f"unknown dtype {name!r}") from None


_OPS: dict[str, Callable] = {
    "transpose": _op_transpose,
    "unflatten": _op_unflatten,
    "flatten": _op_flatten,
    "split": _op_split,
    "concat": _op_concat,
    "fused_qkv": _op_fused_qkv,
    "unfused_qkv": _op_unfused_qkv,
    "rope_permute": _op_rope_permute,
    "rope_unpermute": _op_rope_unpermute,
    "trim": _op_trim,
    "pad": _op_pad,
    "cast": _op_cast,
    "identity": _op_identity,
}


def _inv_transpose(op: Op) -> Op:
    if not op.args:
        return op
    perm = list(op.args)
    return Op("transpose", tuple(int(i) for i in np.argsort(perm)))


def _inv_trim(op: Op) -> Op:
    if len(op.args) < 3:
        raise MappingError(f"{op} cannot be inverted: give the padded size, trim(axis, size, padded)")
    return Op("pad", (op.args[0], op.args[2]))


_INVERSE: dict[str, Callable[[Op], Op]] = {
    "transpose": _inv_transpose,
    "unflatten": lambda op: Op("flatten", op.args),
    "flatten": lambda op: Op("unflatten", op.args),
    "split": lambda op: Op("concat", (op.args[0],) + (op.args[1:] if len(op.args) > 2 else ())),
    "concat": lambda op: Op("split", op.args if len(op.args) > 1 else op.args),
    "fused_qkv": lambda op: Op("unfused_qkv", op.args),
    "unfused_qkv": lambda op: Op("fused_qkv", op.args),
    "rope_permute": lambda op: Op("rope_unpermute", op.args),
    "rope_unpermute": lambda op: Op("rope_permute", op.args),
    "trim": _inv_trim,
    "pad": lambda op: Op("trim", (op.args[0], op.args[1])),
    "cast": lambda op: Op("cast", (op.args[1], op.args[0])) if len(op.args) > 1 else Op("identity"),
    "identity": lambda op: op,
}

# -- tensor-parallel merges ------------------------------------------------------------------


def merge_tp(shards: Sequence[LazyTensor], how: Op, where: str = "") -> LazyTensor:
    """Join the tensor-parallel shards of one tensor (rank order) by `concat`, `halves` or
    `replicated`."""
    shards = list(shards)
    if not shards:
        raise MappingError(f"{where}: no shards to merge")
    if how.name == "replicated":
        ref = shards[0]
        for i, s in enumerate(shards[1:], 1):
            if s.shape != ref.shape:
                raise MappingError(
                    f"{where}: replicated tensor has shape {ref.shape} on rank 0 but {s.shape} on rank {i}"
                )
        return ref
    if how.name == "concat":
        return lazy.concat(shards, how.args[0])
    if how.name == "halves":
        axis = how.args[0]
        firsts, seconds = [], []
        for i, s in enumerate(shards):
            n = s.shape[axis % s.ndim]
            if n % 2:
                raise MappingError(f"{where}: rank {i} shard has odd size {n} on axis {axis}; cannot halve")
            a, b = lazy.split(s, axis, (n // 2, n // 2))
            firsts.append(a)
            seconds.append(b)
        return lazy.concat(firsts + seconds, axis)
    raise MappingError(f"{where}: unknown tp merge {how}")


# -- rules -----------------------------------------------------------------------------------


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
        """Like `apply`, for inverted rules whose sources are stacked (`name[$L]`): each stacked
        tensor is first split into `name[0]`, `name[1]`, ... along its leading axis."""
        expanded: dict[str, LazyTensor] = {}
        stacked_bases = {
            _STACK.match(s).group("base") for r in self.rules for s in r.sources if _STACK.match(s)
        }
        for name, t in tensors.items():
            if name in stacked_bases:
                for i in range(t.shape[0]):
                    expanded[f"{name}[{i}]"] = lazy.index0(t, i)
            else:
                expanded[name] = t
        return self.apply(expanded, strict=strict)


# -- parsing ---------------------------------------------------------------------------------

_VAR = re.compile(r"\{([A-Za-z_]\w*)\}")
_WHEN = re.compile(r"\s+when\s+(not\s+)?([A-Za-z_]\w*)\s*$")
_OP = re.compile(r"^([a-z_]+)\s*(?:\((.*)\))?$")


def _parse_arg(text: str, where: str):
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"[A-Za-z_][\w.]*", text):
        return text
    raise MappingError(f"{where}: bad op argument {text!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_op(text: str, where: str) -> Op:
    m = _OP.match(text.strip())
    if not m or m.group(1) not in _OPS and m.group(1) not in ("halves", "replicated"):
        raise MappingError(f"{where}: unknown op {text.strip()!r} (known: {sorted(_OPS)})")
    args = tuple(_parse_arg(a, where) for a in _split_top(m.group(2) or ""))
    return Op(m.group(1), args)


def parse_rules(
    text: str, variables: Mapping[str, object] | None = None, *, origin: str = "<rules>"
) -> RuleSet:
    """Parse a rules text (see the module docstring); `variables` fill `{var}` and `when VAR`."""
    variables = dict(variables or {})
    rules: list[Rule] = []
    tp_rules: list[TpRule] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{origin}:{lineno}: {line}"
        wm = _WHEN.search(line)
        if wm:
            var = wm.group(2)
            if var not in variables:
                raise MappingError(f"{where}: unknown variable {var!r} in when-clause")
            if bool(variables[var]) == bool(wm.group(1)):
                continue
            line = line[: wm.start()].strip()

        def subst(m: re.Match, where=where) -> str:
            if m.group(1) not in variables:
                raise MappingError(f"{where}: unknown variable {{{m.group(1)}}}")
            return str(variables[m.group(1)])

        line = _VAR.sub(subst, line)
        if line.startswith("tp "):
            pat, sep, how = line[3:].partition(":")
            if not sep:
                raise MappingError(f"{where}: expected 'tp PATTERN : concat(axis)|halves(axis)|replicated'")
            op = _parse_op(how, where)
            if op.name not in ("concat", "halves", "replicated"):
                raise MappingError(f"{where}: tp merge must be concat, halves or replicated")
            tp_rules.append(TpRule(pat.strip(), op, lineno, line))
            continue
        lhs, arrow, rhs = line.partition("->")
        if not arrow:
            raise MappingError(f"{where}: expected 'SOURCE -> TARGET [: ops]'")
        tgt_text, _, ops_text = rhs.partition(":")
        sources = tuple(s.strip() for s in lhs.split(",") if s.strip())
        targets = tuple(t.strip() for t in tgt_text.split(",") if t.strip())
        if not sources or not targets:
            raise MappingError(f"{where}: a rule needs sources and targets")
        ops = tuple(_parse_op(o, where) for o in _split_top(ops_text)) if ops_text.strip() else ()
        rules.append(Rule(sources, targets, ops, lineno, line, origin))
    return RuleSet(tuple(rules), tuple(tp_rules), origin)


def load_rules(path: str, variables: Mapping[str, object] | None = None) -> RuleSet:
    """Parse a rules file (e.g. a user's `--rules FILE`)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise MappingError(f"{path}: cannot read rules file: {e.strerror}") from e
    return parse_rules(text, variables, origin=path)
