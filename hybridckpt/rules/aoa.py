"""Paddle's AOA key-mapping statements, translated into hybridckpt's rules language.

AOA ("all in one" mapping, PaddlePaddle/Paddle: python/paddle/distributed/flex_checkpoint/aoa/
{lexer,parser,macros,aoa_engine}.py, paddlepaddle 3.3.1) maps the keys of a checkpoint (the
source: model-state keys; optimizer states `.moment1_0`, `.w_0`, ... follow their key) to the
keys a model loads. A config is `{"aoa_statements": [...]}` (JSON) or a text file with one
statement per line (`#` comments allowed here). Statements run in order over one namespace of
variables (later statements may use what earlier ones produced):

    A -> B                               rename            -> `A -> B`
    A -> B1, B2, axis=k                  split equally     -> `A -> B1, B2 : split(k)`
    A1, A2 -> B, axis=k                  concatenate       -> `A1, A2 -> B : concat(k[, sizes])`
    A -> _   /   _ -> B                  delete A / B is not loaded (nothing to map)
    A^T -> B                             reverse all axes  -> `A -> B : transpose`
    A -> B, permute="[1,0]"              permute axes      -> `transpose(1, 0)`
    A -> B, dtype='float32'              cast (one way)    -> `cast(float32)`
    A -> B, src_dtype=x, dst_dtype=y     cast both ways    -> `cast(y, x)`
    F -> Q, K, V, fused_qkv, num_heads=H, num_key_value_groups=G[, axis=k]
                                         per kv group `[H/G q heads | k | v]` -> `fused_qkv(k, H, G)`
    F -> Q, K, V, fused_qkv_old, ...     PaddleNLP's per-TP-rank `[q_r | k_r | v_r]` over the n
                                         source shards -> `fused_qkv(k, n*H/G, n)`
    F -> G, U, fused_ffn[, axis=k]       per source shard `[gate_r | up_r]` -> `split(k, 2)`
                                         (n > 1: `unflatten, transpose, flatten` first)
    (and the reverse forms `Q, K, V -> F, fused_qkv...`, `G, U -> F, fused_ffn`)
    $LAYER_ID, $EXPERT_ID                the ids of matching keys -> `$LAYER_ID` captures
    NAME[a:b]                            NAME_a, ..., NAME_{b-1}
    pre.*.suf                            every source key `pre<n>.suf`, by n (a list of keys)
    $LAYER_ID_OFFSET                     source layer i -> target layer i - 1 (expanded per key)
`axis` defaults to 1 (Paddle's Linear weights are `[in, out]`); split/concat need `axis`.

Translation: each statement becomes one stage, a `RuleSet` of its rule and a pass-through
`* -> *`, applied in order (`RuleChain`): a key no statement names is carried over unchanged, as
Paddle carries it. Statements that need the checkpoint (`*`, `$LAYER_ID_OFFSET`, the source
shard count of `fused_ffn` / `fused_qkv_old`, the sizes of a concat for an exact inverse) are
expanded against the source's names and shapes, propagated stage by stage. The reverse
(`aoa_config_reverse`) is the stages in reverse order, each inverted (`RuleSet.invert`); a
one-way `dtype=` cast cannot be reversed (as in Paddle). A statement that cannot be expressed is
one `MappingError` naming the file, the line and the statement.
"""

from __future__ import annotations

import ast
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import MappingResult, RuleSet, parse_rules
from hybridckpt.rules.aoa_syntax import (
    TAGS,
    Statement,
    is_aoa_file,
    parse,
    read_statements,
    tokens,
)

__all__ = ["RuleChain", "Statement", "is_aoa_file", "load", "read_statements", "translate"]

_IDS = ("$LAYER_ID", "$EXPERT_ID")
PASS = "* -> *"
_AS_IS = "!"  # a reverse-only rule: applied as written in the reverse chain, not inverted


def _passes(rule) -> bool:
    """The pass-through rule `* -> *` of every stage."""
    return rule.sources == ("*",) and rule.targets == ("*",)


@dataclass(frozen=True)
class RuleChain:
    """Rule sets applied one after the other (each the rules of one AOA statement plus
    `* -> *`); `apply` and `invert` as `RuleSet`'s."""

    stages: tuple[RuleSet, ...]
    origin: str = "<aoa>"

    def apply(
        self, tensors: Mapping[str, LazyTensor], *, strict: bool = True, unstack: bool = False
    ) -> MappingResult:
        unused = []
        for rs in self.stages:
            res = (rs.apply_unstack if unstack else rs.apply)(tensors, strict=strict)
            unused += [r for r in res.unused if not _passes(r)]
            tensors = res.tensors
        return MappingResult(dict(tensors), (), tuple(unused))

    def apply_unstack(
        self, tensors: Mapping[str, LazyTensor], *, strict: bool = True
    ) -> MappingResult:
        """`apply` with each stage's `RuleSet.apply_unstack` (AOA names stack nothing)."""
        return self.apply(tensors, strict=strict, unstack=True)

    def targets_of(self, name: str) -> tuple[str, ...] | None:
        """`RuleSet.targets_of` through every stage in turn (names alone, nothing read): None
        when a stage has no rule for one of the names (each stage ends in `* -> *`)."""
        names: tuple[str, ...] = (name,)
        for rs in self.stages:
            out: list[str] = []
            for n in names:
                t = rs.targets_of(n)
                if t is None:
                    return None
                out.extend(t)
            names = tuple(out)
        return names

    def for_slot(self, slot: str) -> RuleChain:
        """`RuleSet.for_slot` of every stage (AOA statements change no values: the same chain)."""
        return RuleChain(tuple(rs.for_slot(slot) for rs in self.stages), self.origin)

    def invert(self) -> RuleChain:
        return RuleChain(
            tuple(rs.invert() for rs in reversed(self.stages)), f"reverse of {self.origin}"
        )

    def text(self) -> str:
        """The stages as rules text (one comment line before each stage)."""
        out = []
        for rs in self.stages:
            out.append(f"# {rs.origin}")
            for r in rs.rules:
                if not _passes(r):
                    ops = f" : {', '.join(map(str, r.ops))}" if r.ops else ""
                    out.append(f"{', '.join(r.sources)} -> {', '.join(r.targets)}{ops}")
        return "\n".join(out)


# -- expansion against the names of the current stage -------------------------------------------


class _Names:
    """The tensors as they are before a stage: names -> placeholder tensors of their shapes, and
    the source shard count of each original name."""

    def __init__(self, tensors: Mapping[str, LazyTensor] | None, shards: Mapping[str, int]):
        self.known = tensors is not None
        self.tensors = {k: _placeholder(t.shape, t.dtype) for k, t in (tensors or {}).items()}
        self.shards = dict(shards)

    def need(self, st: Statement, why: str) -> None:
        if not self.known:
            raise MappingError(
                f"{st.where()}: {why} needs the checkpoint's keys (use it as --rules with a source)"
            )

    def _matches(self, pattern: str) -> list[str]:
        parts = re.split(r"(\$LAYER_ID|\$EXPERT_ID)", pattern)
        rx = re.compile("^" + "".join(r"\d+" if p in _IDS else re.escape(p) for p in parts) + "$")
        return [k for k in self.tensors if rx.match(k)]

    def example(self, pattern: str) -> LazyTensor | None:
        """A tensor whose name matches `pattern` (`$LAYER_ID` / `$EXPERT_ID` any number)."""
        found = self._matches(pattern)
        return self.tensors[found[0]] if found else None

    def shard_count(self, st: Statement, pattern: str) -> int:
        """The number of stored blocks of the source tensors `pattern` names (all the same)."""
        counts = {self.shards.get(k, 1) for k in self._matches(pattern)}
        if len(counts) > 1:
            raise MappingError(
                f"{st.where()}: the tensors {pattern!r} names are stored in {sorted(counts)} shards"
            )
        return counts.pop() if counts else 1


def _placeholder(shape, dtype) -> LazyTensor:
    return lazy.ArrayTensor(np.broadcast_to(np.zeros((), np.dtype(dtype)), tuple(shape)))


def _star(names: _Names, st: Statement, name: str) -> list[str]:
    names.need(st, "'*'")
    pre, _, suf = name.partition("*")
    rx = re.compile(rf"^{re.escape(pre)}(\d+){re.escape(suf)}$")
    found = sorted((int(m.group(1)), k) for k in names.tensors if (m := rx.match(k)))
    if not found:
        raise MappingError(f"{st.where()}: no key matches {name!r}")
    return [k for _, k in found]


def _offset_statements(names: _Names, st: Statement) -> list[Statement]:
    """macros.py `layer_id_offset_macro`: one statement per source layer id i (targets i - 1)."""
    names.need(st, "$LAYER_ID_OFFSET")
    toks = tokens(st)
    first = next(v for k, v in toks if k == "IDENT" and "$LAYER_ID_OFFSET" in v)
    pre, suf = first.split("$LAYER_ID_OFFSET", 1)
    rx = re.compile(rf"^{re.escape(pre)}(\d+){re.escape(suf)}$")
    ids = sorted({int(m.group(1)) for k in names.tensors if (m := rx.match(k))})
    keywords = {
        "axis",
        "num_heads",
        "num_key_value_groups",
        "permute",
        "dtype",
        "src_dtype",
        "dst_dtype",
        *TAGS,
    }
    out = []
    for i in ids:
        text, after = "", False
        for k, v in toks:
            if k == "RARROW":
                after = True
            n = i - 1 if after else i
            if k == "IDENT" and "$LAYER_ID_OFFSET" in v:
                text += v.replace("$LAYER_ID_OFFSET", str(n))
            elif k == "IDENT" and v not in keywords:
                text += f"{v}.layer.{n}"
            else:
                text += v if k != "COMMA" else ", "
            text += " " if k in ("RARROW", "EQUAL") else ""
        out.append(Statement(st.origin, st.line, text))
    return out


def _perm_swap(ndim: int, axis: int) -> str:
    """The permutation swapping axes `axis` and `axis + 1` of a tensor of `ndim` dims."""
    p = list(range(ndim))
    p[axis], p[axis + 1] = p[axis + 1], p[axis]
    return ", ".join(map(str, p))


def _rule(names: _Names, st: Statement, reverse: bool) -> list[str]:
    """The rules-text lines of one statement (after `*` and `^T` handling)."""
    left, right, attrs, tag = parse(st)
    left = [k for n in left for k in (_star(names, st, n) if "*" in n else [n])]
    right = [k for n in right for k in (_star(names, st, n) if "*" in n else [n])]
    if any("*" in n for n in right):
        raise MappingError(f"{st.where()}: '*' on the right side is not supported")
    pre, ops = [], []
    # A^T: reverse the axes of A first (macros.py transpose_macro)
    for i, n in enumerate(left):
        if n.endswith("^T"):
            base = n[:-2]
            if len(left) == 1 and tag is None and not attrs.keys() - {"axis"}:
                left[i], ops = base, ["transpose"]
            else:
                pre.append(f"{base} -> {base}_transpose_tmp : transpose")
                left[i] = f"{base}_transpose_tmp"
    if any(n.endswith("^T") for n in right):
        raise MappingError(f"{st.where()}: cannot assign to a transpose (B^T) on the right side")
    axis = attrs.get("axis", 1)
    src, dst = ", ".join(left), ", ".join(right)

    def sizes(ns):
        ex = [names.example(n) for n in ns]
        return [] if any(e is None for e in ex) else [e.shape[axis] for e in ex]

    if tag == "fused_qkv":
        h, g = attrs.get("num_heads"), attrs.get("num_key_value_groups")
        if not (isinstance(h, int) and isinstance(g, int) and h > 0 and g > 0 and h % g == 0):
            raise MappingError(
                f"{st.where()}: fused_qkv needs num_heads divisible by num_key_value_groups"
            )
        if len(left) == 1 and len(right) == 3:
            ops.append(f"fused_qkv({axis}, {h}, {g})")
        elif len(left) == 3 and len(right) == 1:
            ops.append(f"unfused_qkv({axis}, {h}, {g})")
        else:
            raise MappingError(f"{st.where()}: fused_qkv maps one tensor to q, k, v or back")
    elif tag in ("fused_ffn", "fused_qkv_old"):
        if len(left) == 1:
            names.need(st, f"{tag} (its source shard count)")
            n = names.shard_count(st, left[0])
            ex = names.example(left[0])
            if ex is None:
                raise MappingError(f"{st.where()}: no key matches {left[0]!r}")
            if tag == "fused_ffn":
                if n > 1:
                    ops += [
                        f"unflatten({axis}, {n}, 2, -1)",
                        f"transpose({_perm_swap(ex.ndim + 2, axis)})",
                        f"flatten({axis}, 2, {n}, -1)",
                    ]
                if len(right) == 2:
                    ops.append(f"split({axis}, 2)")
                elif len(right) != 1:
                    raise MappingError(
                        f"{st.where()}: fused_ffn maps one tensor to gate, up (or one)"
                    )
            else:
                h, g = attrs.get("num_heads"), attrs.get("num_key_value_groups")
                if not (
                    isinstance(h, int)
                    and isinstance(g, int)
                    and h > 0
                    and g > 0
                    and h % g == 0
                    and g % n == 0
                ):
                    raise MappingError(
                        f"{st.where()}: fused_qkv_old needs num_heads divisible by num_key_value_groups, "
                        f"and that by the {n} source shards"
                    )
                ops.append(f"fused_qkv({axis}, {n * h // g}, {n})")
                if len(right) == 1:
                    total = ex.shape[axis]
                    hd = total // (h + 2 * g)
                    ops.append(f"concat({axis}, {h * hd}, {g * hd}, {g * hd})")
                elif len(right) != 3:
                    raise MappingError(
                        f"{st.where()}: fused_qkv_old maps one tensor to q, k, v (or one)"
                    )
        elif len(right) == 1:  # gate, up -> fused (or q, k, v -> fused): one target shard
            ops.append(
                f"concat({axis}, {', '.join(map(str, sz))})"
                if (sz := sizes(left))
                else f"concat({axis})"
            )
        else:
            raise MappingError(f"{st.where()}: {tag}: many names on both sides")
    elif right == ["_"]:
        if len(left) != 1:
            raise MappingError(f"{st.where()}: delete one name at a time")
        return pre + ([] if reverse else [f"{left[0]} -> _"])
    elif left == ["_"]:
        return pre + ([f"{_AS_IS}{right[0]} -> _"] if reverse else [])
    elif len(left) > 1 and len(right) > 1:
        raise MappingError(
            f"{st.where()}: many names on both sides of '->' (Paddle refuses it too)"
        )
    elif len(left) > 1 or len(right) > 1:
        if set(attrs) != {"axis"}:
            raise MappingError(f"{st.where()}: a split or concat takes one attribute, axis")
        if len(right) > 1:
            ops.append(f"split({axis})")
        else:
            sz = sizes(left)
            ops.append(f"concat({axis}, {', '.join(map(str, sz))})" if sz else f"concat({axis})")
    else:
        extra = set(attrs) - {"axis"}
        if extra == {"permute"}:
            p = ast.literal_eval(attrs["permute"]) if isinstance(attrs["permute"], str) else None
            if not isinstance(p, list):
                raise MappingError(f'{st.where()}: permute must be a list such as "[1, 0]"')
            ops.append(f"transpose({', '.join(map(str, p))})" if p else "transpose")
        elif extra == {"dtype"}:
            if reverse:
                raise MappingError(
                    f"{st.where()}: a dtype= cast cannot be reversed (write src_dtype=..., dst_dtype=...)"
                )
            ops.append(f"cast({attrs['dtype']})")
        elif extra == {"src_dtype", "dst_dtype"}:
            ops.append(f"cast({attrs['dst_dtype']}, {attrs['src_dtype']})")
        elif extra:
            raise MappingError(f"{st.where()}: unsupported attributes {sorted(extra)}")
    return pre + [f"{src} -> {dst}" + (f" : {', '.join(ops)}" if ops else "")]


def translate(
    statements: list[Statement],
    *,
    source: Mapping[str, LazyTensor] | None = None,
    shards: Mapping[str, int] | None = None,
    reverse: bool = False,
    origin: str = "<aoa>",
) -> RuleChain:
    """The `RuleChain` of AOA `statements` (`reverse`: of `aoa_config_reverse`, the export
    direction). `source`: the checkpoint's tensors (names and shapes) for the statements that
    expand against them; `shards`: the number of stored blocks of each source tensor."""
    names = _Names(source, shards or {})
    stages: list[tuple[RuleSet, bool]] = []  # (rules, applied as is in the reverse chain)
    for st in statements:
        expanded = _offset_statements(names, st) if "$LAYER_ID_OFFSET" in st.text else [st]
        for one in expanded:
            for text in _rule(names, one, reverse):
                as_is = text.startswith(_AS_IS)
                try:
                    rs = parse_rules(
                        f"{text.lstrip(_AS_IS)}\n{PASS}\n", origin=f"{one.origin}:{one.line}"
                    )
                except MappingError as e:
                    raise MappingError(f"{one.where()}: {e}") from None
                stages.append((rs, as_is))
                if names.known and not as_is:
                    try:
                        res = rs.apply(names.tensors, strict=False)
                    except MappingError as e:
                        raise MappingError(f"{one.where()}: {e}") from None
                    if any(not _passes(r) for r in res.unused):
                        raise MappingError(f"{one.where()}: matches no key of the checkpoint")
                    names.tensors = dict(res.tensors)
    if reverse:
        return RuleChain(
            tuple(rs if as_is else rs.invert() for rs, as_is in reversed(stages)),
            f"reverse of {origin}",
        )
    return RuleChain(tuple(rs for rs, _ in stages), origin)


def load(path: str, *, source=None, reverse: bool = False) -> RuleChain:
    """An AOA config file as a `RuleChain` (see `translate`); `source`: the checkpoint's tensors
    under the names the statements use (their stored block counts are read off the tensors)."""
    shards = {k: _blocks(t) for k, t in (source or {}).items()}
    return translate(
        read_statements(path), source=source, shards=shards, reverse=reverse, origin=os.fspath(path)
    )


def _blocks(t: LazyTensor) -> int:
    """How many stored blocks a source tensor is made of (Paddle's distinct global offsets)."""
    pieces = getattr(t, "pieces", None)
    if pieces is None:
        return 1
    return len({tuple(o) for o, _ in pieces}) if math.prod(t.shape) else 1
