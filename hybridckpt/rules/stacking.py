"""Stack indices of a rules pattern: `name[$L]`, `name[$L, $E]`, `name[$L in 1,3,5, $E]`.

A target (or, in inverted rules, a source) may end with a bracket of one or more indices. Each
index is a capture variable `$X`, optionally restricted to a list: `$X in v0,v1,...` (the list
is usually a `{var}` of the model config, expanded before parsing: `[$L in {moe_layers}, $E]`;
list items are the decimal numbers after `in` up to the next `$`; the list may be empty).

- Stacking (`StackSpec.positions`): the matched tensors are stacked on as many new leading
  axes as there are indices, in the order written. A plain index `$X` puts the tensor whose
  capture is `n` at position `n` (the captures must then run 0..n-1); a list index puts it at
  the position of its value in the list (`[$L in 1,3,5]`: layer 3 at position 1), and a capture
  not in the list does not match the rule (another rule may take the key).
- Unstacking (`StackSpec.captures`, for inverted rules): the position `i` of a stacked axis
  gives back the capture: `i` itself, or `list[i]`. Expanded names are spelled
  `base[i0,i1]` (`unstacked_name`).

`assemble` builds the nested `lazy.Stack` of a complete grid of positions (every position of
every axis given exactly once); each part stays the view it was (nothing is read).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hybridckpt import lazy
from hybridckpt.errors import MappingError
from hybridckpt.lazy import LazyTensor

_SUFFIX = re.compile(r"^(?P<base>.*?)\[(?P<inside>[^\[\]]*)\]$")
_INDEX = re.compile(r"^\$(?P<var>[A-Za-z_]\w*)(?P<list>\s+in(?:\s+(?P<first>.*))?)?$")
_EXPANDED = re.compile(r"^(?P<base>.*)\[(?P<pos>\d+(?:,\d+)*)\]$")


@dataclass(frozen=True)
class StackIndex:
    """One stacked axis: the capture variable and, for a list index, the allowed values."""

    var: str
    values: tuple[int, ...] | None = None

    def position(self, capture: str) -> int | None:
        """The stack position of a captured value, or None when a list does not hold it."""
        n = int(capture)
        if self.values is None:
            return n
        return self.values.index(n) if n in self.values else None

    def capture(self, position: int) -> str | None:
        """The capture at a stack position (None past the end of a list)."""
        if self.values is None:
            return str(position)
        return str(self.values[position]) if position < len(self.values) else None

    def size(self, positions: set[int]) -> int:
        """The axis length: the list's, else one past the largest position given."""
        return len(self.values) if self.values is not None else max(positions) + 1


@dataclass(frozen=True)
class StackSpec:
    """A pattern `base[index, ...]` taken apart; `indices` is empty for a plain name."""

    base: str
    indices: tuple[StackIndex, ...] = ()

    @property
    def stacked(self) -> bool:
        return bool(self.indices)

    def positions(self, caps: Mapping[str, str]) -> tuple[int, ...] | None:
        """Stack positions of a match's captures (None: a list index does not hold one)."""
        out = []
        for ix in self.indices:
            if ix.var not in caps:
                raise MappingError(f"stack index ${ix.var} of {self.base!r} is not captured by the source")
            p = ix.position(caps[ix.var])
            if p is None:
                return None
            out.append(p)
        return tuple(out)

    def captures(self, positions: tuple[int, ...]) -> dict[str, str] | None:
        """The captures of stack positions (None when a position is past a list's end)."""
        out = {}
        for ix, p in zip(self.indices, positions, strict=True):
            c = ix.capture(p)
            if c is None:
                return None
            out[ix.var] = c
        return out


def _split_indices(inside: str) -> list[str]:
    """`$L in 1,3, $E` -> ["$L in 1,3", "$E"]: a comma before a number continues a list."""
    items: list[str] = []
    for part in (p.strip() for p in inside.split(",")):
        if part.startswith("$") or not items:
            items.append(part)
        else:
            items[-1] += "," + part
    return items


def parse_stack(pattern: str, where: str = "") -> StackSpec:
    """A pattern's base and its stack indices (none when it has no `[...]` suffix)."""
    m = _SUFFIX.match(pattern)
    if not m:
        return StackSpec(pattern)
    indices = []
    for item in _split_indices(m.group("inside")):
        im = _INDEX.match(item)
        if not im:
            raise MappingError(f"{where}: bad stack index {item!r} in {pattern!r}; expected $X or $X in N,N,...")
        values = None
        if im.group("list"):
            text = im.group("first") or ""
            try:
                values = tuple(int(v) for v in text.split(",") if v.strip())
            except ValueError:
                raise MappingError(f"{where}: list of ${im.group('var')} in {pattern!r} must be integers") from None
            if len(set(values)) != len(values):
                raise MappingError(f"{where}: list of ${im.group('var')} in {pattern!r} repeats a value")
        indices.append(StackIndex(im.group("var"), values))
    vars_ = [ix.var for ix in indices]
    if len(set(vars_)) != len(vars_):
        raise MappingError(f"{where}: stack indices of {pattern!r} repeat a variable")
    return StackSpec(m.group("base"), tuple(indices))


def unstacked_name(base: str, positions: tuple[int, ...]) -> str:
    """The name of one element of a stacked tensor: `base[i0,i1]`."""
    return f"{base}[{','.join(map(str, positions))}]"


def split_unstacked(name: str) -> tuple[str, tuple[int, ...]] | None:
    """`base[i0,i1]` -> (base, (i0, i1)); None for a name with no such suffix."""
    m = _EXPANDED.match(name)
    if not m:
        return None
    return m.group("base"), tuple(int(p) for p in m.group("pos").split(","))


def unstack(t: LazyTensor, depth: int) -> dict[tuple[int, ...], LazyTensor]:
    """Every element of the `depth` leading axes of `t` (`lazy.index0` views, built by
    `lazy.index0_all`: nothing read, the boxes checked once per axis)."""
    out: dict[tuple[int, ...], LazyTensor] = {(): t}
    for _ in range(depth):
        out = {pos + (i,): part for pos, x in out.items() for i, part in enumerate(lazy.index0_all(x))}
    return out


def assemble(
    slot: Mapping[tuple[int, ...], LazyTensor], spec: StackSpec, where: str, base: str
) -> LazyTensor:
    """The nested `lazy.Stack` of a grid of positions; every position must be given."""
    sizes = [ix.size({p[d] for p in slot}) for d, ix in enumerate(spec.indices)]
    grid = list(itertools.product(*(range(n) for n in sizes)))
    missing = [p for p in grid if p not in slot]
    if missing:
        caps = [spec.captures(p) for p in missing[:10]]
        shown = [int(c[spec.indices[0].var]) for c in caps] if len(sizes) == 1 else caps
        more = f" ({len(missing)} in all)" if len(missing) > 10 else ""
        raise MappingError(f"{where}: cannot stack {base}: indices {shown}{more} are missing")

    def build(prefix: tuple[int, ...]) -> LazyTensor:
        if len(prefix) == len(sizes):
            return slot[prefix]
        return lazy.Stack(tuple(build(prefix + (i,)) for i in range(sizes[len(prefix)])))

    if any(n == 0 for n in sizes):
        raise MappingError(f"{where}: cannot stack {base}: an index list is empty")
    return build(())
