"""A MaxText decoder scanned in blocks of nested groups (Qwen3-Next: maxtext 0.2.5 models/qwen3.py
`Qwen3NextScannableBlock`): each block of `cycle` layers splits into named groups of block
positions, a group's arrays under `decoder.layers.<group>.<path>`:

- an inner-scanned group (`inner`, Qwen3-Next's `local_layers`, the c - 1 delta-net positions):
  a layer's `[d0, d1, ...]` becomes `[d0, blocks, positions, d1, ...]` (the block scan and the
  inner scan each put their axis at `param_scan_axis` 1, the outer one first);
- a single-position group (`global_layer`, the full-attention layer; its length-1 scan is a
  runtime boundary, not a stack): `[d0, blocks, d1, ...]`.

Layer i = b * cycle + p is block b, position p. The rules name each layer `decoder.layers_$L.*`
(unscanned, its own tree); `to_disk` / `from_disk` move between the two forms. A dialect gives the
groups as `scan_groups(cfg)`: (name, positions, inner) tuples covering 0..cycle-1 once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridckpt import lazy
from hybridckpt.errors import FormatError, MappingError
from hybridckpt.lazy import LazyTensor

LAYERS = "decoder.layers."
SCAN_AXIS = 1  # MaxText's param_scan_axis default (configs/base.yml)
_UNSCANNED = re.compile(r"^decoder\.layers_(\d+)\.(.+)$")


@dataclass(frozen=True)
class ScanGroup:
    """Block positions scanned together under `decoder.layers.<name>.`; `inner`: the positions on
    their own axis after the blocks' (else exactly one position, blocks only)."""

    name: str
    positions: tuple[int, ...]
    inner: bool


def groups_of(raw: Sequence, cycle: int) -> tuple[ScanGroup, ...]:
    """A dialect's `scan_groups` tuples as `ScanGroup`s (checked: they cover 0..cycle-1 once)."""
    groups = tuple(ScanGroup(str(n), tuple(int(p) for p in ps), bool(inner)) for n, ps, inner in raw)
    got = sorted(p for g in groups for p in g.positions)
    if got != list(range(cycle)) or any(not g.inner and len(g.positions) != 1 for g in groups):
        raise ValueError(f"scan groups {groups} do not cover the {cycle} block positions once")
    return groups


def _move_in(t: LazyTensor, lead: int) -> LazyTensor:
    """`[lead axes..., d0, d1, ...]` -> `[d0, lead axes..., d1, ...]` (SCAN_AXIS 1)."""
    perm = list(range(lead, t.ndim))
    perm[SCAN_AXIS:SCAN_AXIS] = list(range(lead))
    return lazy.transpose(t, perm)


def to_disk(tensors: Mapping[str, LazyTensor], cycle: int, groups: Sequence[ScanGroup]) -> dict[str, LazyTensor]:
    """Per-layer names `decoder.layers_<i>.X` -> the scanned groups (module doc); others as they
    are. Every layer must be there for each block position a parameter has."""
    out: dict[str, LazyTensor] = {}
    per_layer: dict[str, dict[int, LazyTensor]] = {}
    for name, t in tensors.items():
        m = _UNSCANNED.match(name)
        if m is None:
            out[name] = t
        else:
            per_layer.setdefault(m.group(2), {})[int(m.group(1))] = t
    if not per_layer:
        return out
    n = 1 + max(i for layers in per_layer.values() for i in layers)
    blocks = -(-n // cycle)
    for rest, layers in per_layer.items():
        for g in groups:
            held = sorted(i for i in layers if i % cycle in g.positions)
            if not held:
                continue
            want = [b * cycle + p for b in range(blocks) for p in g.positions]
            if held != sorted(want):
                raise MappingError(f"export --to maxtext: decoder.layers_<i>.{rest}: the scanned group {g.name} needs "
                                   f"layers {want[:16]}, found {held[:16]}")  # fmt: skip
            if g.inner:
                stacked = lazy.Stack(tuple(lazy.Stack(tuple(layers[b * cycle + p] for p in g.positions))
                                           for b in range(blocks)))  # fmt: skip
                out[f"{LAYERS}{g.name}.{rest}"] = _move_in(stacked, 2)
            else:
                stacked = lazy.Stack(tuple(layers[b * cycle + g.positions[0]] for b in range(blocks)))
                out[f"{LAYERS}{g.name}.{rest}"] = _move_in(stacked, 1)
    return out


def from_disk(
    tensors: Mapping[str, LazyTensor], where: str, cycle: int, groups: Sequence[ScanGroup], num_layers: int
) -> dict[str, LazyTensor]:
    """The scanned groups -> per-layer names `decoder.layers_<i>.X`; unscanned names as they are.
    A group's array must hold the config's blocks (and positions) on its scan axes, checked
    before any view is made (the axes are the file's word)."""
    by_name = {g.name: g for g in groups}
    blocks = num_layers // cycle
    out: dict[str, LazyTensor] = {}
    for name, t in tensors.items():
        if not name.startswith(LAYERS):
            out[name] = t
            continue
        head, _, rest = name[len(LAYERS):].partition(".")
        g = by_name.get(head)
        if g is None or not rest:
            raise FormatError(f"{where}: {name}: expected {LAYERS}<group>.* with a group of {sorted(by_name)}")
        lead = (blocks, len(g.positions)) if g.inner else (blocks,)
        if t.ndim <= len(lead) or tuple(t.shape[SCAN_AXIS:SCAN_AXIS + len(lead)]) != lead:
            raise FormatError(f"{where}: {name}: expected {lead} (blocks{', positions' if g.inner else ''} of the "
                              f"{num_layers} layers) on axes from {SCAN_AXIS}, found shape {t.shape}")  # fmt: skip
        axes = list(range(SCAN_AXIS, SCAN_AXIS + len(lead)))
        first = lazy.transpose(t, axes + [a for a in range(t.ndim) if a not in axes])
        for b in range(blocks):
            block = lazy.index0(first, b)
            for k, p in enumerate(g.positions):
                layer = f"decoder.layers_{b * cycle + p}.{rest}"
                if layer in tensors:
                    raise FormatError(f"{where}: {layer} is both scanned ({name}) and unscanned")
                out[layer] = lazy.index0(block, k) if g.inner else block
    return out
