"""DeepSpeed's flat partitions cut back into parameters: stages 1/2, BF16_Optimizer, stage 3.

- stage 1/2: per group, rank r holds partition r of the group's flat fp32 vector: params back
  to back in `param_shapes` order, each followed by `param_alignment_paddings[g][i]` elements
  (absent = 0), the tail padded to a multiple of 2*dp and split in dp equal partitions; the
  padding is stripped on save, so the last rank's partition is shorter by `group_paddings[g]`.
- BF16_Optimizer: the same, but the partitions are NOT stripped: the last rank's
  `group_paddings[g]` tail elements are padding.
- stage 3: every param is split on its own: `pn = ceil(numel/dp)`, rank r holds elements
  `[r*pn, (r+1)*pn)` of the flattened param (zero-padded; the padding holds garbage and is never
  read). A rank's sub-groups joined end to end hold its partitions of the params of the merged
  `param_shapes`, back to back. A param is one `Zero3Flat` over the ranks' flats (not a slice
  per rank: its size does not grow with the rank count).
Every slot is cut exactly like the fp32 master. Frozen params come from the model states'
`frozen_param_fragments` (whole for stage <= 2, the rank's `ceil(numel/dp)` partition for 3).
"""

from __future__ import annotations

import math

from hybridckpt import lazy, values
from hybridckpt.errors import FormatError
from hybridckpt.formats.deepspeed.files import cut, flat, shape_of
from hybridckpt.formats.deepspeed.ranks import Rank
from hybridckpt.formats.deepspeed.zero3_flat import Zero3Flat, edges
from hybridckpt.lazy import LazyTensor


def zero12(ranks: list[Rank], shapes: list[dict], align_pads, stripped: bool, model_file: str):
    """name -> {"fp32": master, slot: tensor, ...} of every trainable param."""
    out = {}
    if any(len(r.fp32) != len(shapes) for r in ranks):
        raise FormatError(
            f"{ranks[0].path}: {len(ranks[0].fp32)} flat groups, but {model_file} has "
            f"param_shapes for {len(shapes)} groups"
        )
    for g, group in enumerate(shapes):
        parts: dict[str, list] = {k: [] for k in ranks[0].flats()}
        for r in ranks:
            n = r.fp32[g].size - (0 if stripped else r.paddings[g])
            if n < 0:
                raise FormatError(
                    f"{r.path}: group {g} padding {r.paddings[g]} exceeds its partition"
                )
            for key, pieces in r.flats().items():
                t = pieces[g]
                if t.size < n:
                    raise FormatError(
                        f"{r.path}: group {g} {key} has {t.size} elements, the fp32 partition {n}"
                    )
                parts[key].append(lazy.slice_axis(t, 0, 0, n))
        flats = {k: lazy.concat(v, 0) for k, v in parts.items()}
        pads = list(align_pads[g]) if align_pads is not None else [0] * len(group)
        if len(pads) != len(group):
            raise FormatError(
                f"{ranks[0].path}: param_alignment_paddings[{g}] has {len(pads)} entries for "
                f"{len(group)} params"
            )
        pos = 0
        for (name, shape), pad in zip(group.items(), pads, strict=True):
            shape = shape_of(shape, f"{model_file}: param_shapes '{name}'")
            numel = math.prod(shape)
            if pos + numel > flats["fp32"].size:
                break
            out[name] = {k: cut(f, pos, numel, shape) for k, f in flats.items()}
            pos += numel + int(pad)
        total = flats["fp32"].size
        needed = sum(math.prod(shape_of(s, model_file)) for s in group.values()) + sum(
            int(p) for p in pads
        )
        if needed != total:
            raise FormatError(
                f"{model_file}: param_shapes group {g} needs {needed} elements (params + alignment "
                f"padding) but the {len(ranks)} partitions of 'single_partition_of_fp32_groups' "
                f"hold {total} after padding: numel totals do not add up"
            )
    return out


def zero3(ranks: list[Rank], shapes: list[dict], model_file: str):
    """name -> {"fp32": master, slot: tensor, ...} of every trainable param."""
    dp = len(ranks)
    merged = [
        (n, shape_of(s, f"{model_file}: param_shapes '{n}'"))
        for grp in shapes
        for n, s in grp.items()
    ]
    per_rank = sum(math.ceil(math.prod(s) / dp) for _, s in merged)
    flats = []
    for r in ranks:
        f = {k: lazy.concat(v, 0) for k, v in r.flats().items()}
        for k, pieces in r.slots.items():
            if [t.size for t in pieces] != [t.size for t in r.fp32]:
                raise FormatError(f"{r.path}: {k} sub-group sizes differ from fp32_flat_groups")
        if f["fp32"].size != per_rank:
            raise FormatError(
                f"{r.path}: 'fp32_flat_groups' hold {f['fp32'].size} elements, but {model_file} "
                f"param_shapes need {per_rank} per rank (sum of ceil(numel/{dp})): numel totals do "
                f"not add up"
            )
        flats.append(f)
    # one Zero3Flat per param and kind over the ranks' flats (shared): not a slice per rank
    per_kind = {k: tuple(f[k] for f in flats) for k in flats[0]}
    bounds = {k: edges(v) for k, v in per_kind.items()}
    out = {}
    off = 0
    for name, shape in merged:
        numel = math.prod(shape)
        pn = math.ceil(numel / dp)
        out[name] = {
            k: lazy.reshape(Zero3Flat(v, off, pn, numel, bounds[k]), shape)
            for k, v in per_kind.items()
        }
        off += pn
    return out


def frozen_params(models: list[dict], stage: int, model_files: list[str]) -> dict[str, LazyTensor]:
    shapes = values.mapping(models[0].get("frozen_param_shapes") or {}, model_files[0], "frozen_param_shapes")
    fragments = [values.mapping(m.get("frozen_param_fragments") or {}, f, "frozen_param_fragments")
                 for m, f in zip(models, model_files, strict=True)] if shapes else []
    out = {}
    dp = len(models)
    for name, s in shapes.items():
        shape = shape_of(s, f"{model_files[0]}: frozen_param_shapes '{name}'")
        numel = math.prod(shape)
        if stage == 3:
            frags = []
            for m, f in zip(fragments, model_files, strict=True):
                t = m.get(name)
                if not isinstance(t, LazyTensor):
                    raise FormatError(f"{f}: no frozen_param_fragments '{name}'")
                if t.size != math.ceil(numel / dp):
                    raise FormatError(
                        f"{f}: frozen_param_fragments '{name}' has {t.size} elements, expected {math.ceil(numel / dp)}"
                    )
                frags.append(flat(t, f))
            out[name] = cut(lazy.concat(frags, 0), 0, numel, shape)
        else:
            t = fragments[0].get(name)
            if not isinstance(t, LazyTensor) or t.size != numel:
                raise FormatError(
                    f"{model_files[0]}: frozen_param_fragments '{name}' is not a {shape} tensor"
                )
            out[name] = lazy.reshape(t, shape)
    return out
