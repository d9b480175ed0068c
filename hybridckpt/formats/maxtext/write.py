"""Export into MaxText's checkpoint: `hybridckpt export SRC OUT --to maxtext [--optimizer]
[--scan-layers/--no-scan-layers]`.

What is written (`formats/maxtext/layout.py` has the layout, docs/maxtext.md the facts and how to point
MaxText at it): `OUT/<step>/items/`, an Orbax pytree checkpoint of MaxText's train state, with
`OUT/<step>/_CHECKPOINT_METADATA` naming Orbax's v1 PyTreeHandler for `items` as MaxText's own
Checkpointer does (maxtext 0.2.5 common/checkpointing.py `save_checkpoint`; the save itself is
`formats.maxtext.save_state`, the store's streaming Orbax save), so MaxText 0.2.5
restores it with `load_parameters_path=OUT/<step>/items` (weights) or
`load_full_state_path=OUT/<step>/items` (with `--optimizer`: weights, Adam's moments, step).

- params: the family's MaxText names and layouts (the inverse of its `maxtext.rules`: kernels
  `[in, out]` with heads split, the query pre-scaled by 1/sqrt(head_dim) in float32, q/k rows in
  MaxText's RoPE order), scanned layers stacked on axis 1 (or one `decoder.layers_<i>` per layer
  with `scan_layers=False`);
- with the optimizer: `opt_state` as optax's `adamw` chain state MaxText builds for its default
  config (`[ScaleByAdamState(count, mu, nu), None, ScaleByScheduleState(count)]`), mu and nu mapped
  like their params (the query's rescaled: mu * sqrt(head_dim), nu * head_dim, `Op.for_slot`),
  both counts and `step` the source's step.

Every array is streamed from the lazy source tensors (`store.stream`: tile by tile, raw chunks,
one chunk per layer of a stacked array), through `writers.destination.Destination`; an
`OUT/maxtext_overrides.json` says the MaxText config overrides of the model and what MaxText cannot
express of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import ConfigError, MappingError
from hybridckpt.formats.maxtext import layout as maxtext
from hybridckpt.lazy.dtypes import cast_floating
from hybridckpt.naming import nest
from hybridckpt.writers.destination import Destination


def maxtext_tensors(named, cfg, *, optimizer: bool, scan_layers: bool = True, dtype=None) -> dict[str, Any]:
    """The flat MaxText train state (dotted item paths, `formats.maxtext.layout`) of `named` (HF names:
    params, slots, step) for the model `cfg`: lazy tensors, and ints for the counts."""
    inverse = maxtext.rules(cfg).invert()
    res = inverse.apply(cast_floating(named.params, dtype)[0], strict=False)  # (None: as stored)
    if res.unconsumed:
        raise MappingError(
            f"export --to maxtext: no MaxText name for {', '.join(res.unconsumed[:10])} "
            f"(family {maxtext.dialect(cfg).family!r}, {maxtext.dialect(cfg).rules()[1]})"
        )
    params = res.tensors
    cycle, groups, axis0 = maxtext.layer_cycle(cfg), maxtext.scan_groups(cfg), maxtext.layer_axis_0(cfg)
    flat: dict[str, Any] = {maxtext.PARAMS + k: t
                            for k, t in maxtext.to_disk(params, scan_layers, cycle, groups, axis0=axis0).items()}
    step = int(named.step or 0)
    flat[maxtext.STEP] = step
    if optimizer:
        weights_only = maxtext.dialect(cfg).get("WEIGHTS_ONLY")
        if weights_only:
            raise ConfigError(f"export --to maxtext --optimizer: {weights_only}")
        if named.step is None:
            raise ConfigError("export --to maxtext --optimizer: the source records no optimizer step")
        missing = [s for s in maxtext.SLOTS if s not in named.slots]
        if missing:
            raise ConfigError(
                f"export --to maxtext --optimizer: MaxText's AdamW needs {sorted(maxtext.SLOTS)}; "
                f"the source has {sorted(named.slots) or 'no optimizer state'}"
            )
        for slot, prefix in maxtext.SLOTS.items():
            got = inverse.for_slot(slot).apply(named.slots[slot], strict=False).tensors
            lacking = sorted(set(params) - set(got))
            if lacking:
                raise MappingError(f"export --to maxtext --optimizer: no {slot} for {lacking[:10]}")
            got = {k: lazy.cast(got[k], np.float32) for k in params}
            flat.update({prefix + k: t for k, t in maxtext.to_disk(got, scan_layers, cycle, groups, axis0=axis0).items()})
        flat[maxtext.ADAM_COUNT] = step
        flat[maxtext.SCHEDULE_COUNT] = step
    return flat


def _tree(flat: dict[str, Any], optimizer: bool) -> dict[str, Any]:
    """The nested train state; `opt_state` the optax chain's list (its middle state None)."""
    tree = nest({k: v for k, v in flat.items() if not k.startswith("opt_state.")})
    if optimizer:
        opt = nest({k[len("opt_state."):]: v for k, v in flat.items() if k.startswith("opt_state.")})
        tree["opt_state"] = [opt["0"], None, opt["2"]]
    return tree


def write_export(request) -> Any:
    """The `maxtext` format's writer (see the module doc). `request.options`: `scan_layers`
    (default True)."""
    from hybridckpt.formats.maxtext import save_state
    from hybridckpt.writers import Written, cast_notes, preflight

    preflight(request)

    cfg, named = request.config, request.named
    if cfg is None:
        raise ConfigError("export --to maxtext: needs a model config (the source has none; pass --config)")
    scan_layers = bool(request.options.get("scan_layers", True))
    flat = maxtext_tensors(named, cfg, optimizer=request.optimizer, scan_layers=scan_layers, dtype=request.dtype)
    step = int(flat[maxtext.STEP])
    tree = _tree(flat, request.optimizer)
    dest = Destination(request.out, overwrite=request.overwrite, sources=request.sources, marker=True)
    with dest as tmp:
        save_state(tmp, step, tree, scan_layers=scan_layers)
        (Path(tmp) / "maxtext_overrides.json").write_text(
            json.dumps({"overrides": maxtext.overrides(cfg), "notes": maxtext.notes(cfg)}, indent=1, default=str)
        )
        dest.commit()
    tensors = [v for v in flat.values() if isinstance(v, lazy.LazyTensor)]
    files = (f"{step}/{maxtext.ITEM}", f"{step}/_CHECKPOINT_METADATA", "maxtext_overrides.json")
    return Written(files, len(tensors), sum(t.nbytes for t in tensors), cast_notes(request))
