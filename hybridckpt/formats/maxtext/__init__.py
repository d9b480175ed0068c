"""MaxText checkpoints through our Orbax machinery: the reader of a MaxText run
(`hybridckpt inspect/import/export` of `<root>/<step>/items`) and the streaming save of
`export --to maxtext`.

The layout and the mapping are `formats/maxtext/layout.py` (and the family's `maxtext` dialect); what
this module adds is the Orbax side, which lives with our store: the arrays are read lazily by
`containers.orbax.reader.item_arrays` (a box read reads only its chunks; zarr v2/v3, OCDBT or not, as MaxText
writes them), and written by the store's streaming handler (`store.stream`, `store.stream_orbax`:
tile by tile from the lazy source tensors). `formats/maxtext/write.py` maps and lays out the train state;
the job hands it `save_state` (the writers sit below the store).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridckpt.errors import CheckpointError, FormatError
from hybridckpt.formats.maxtext import layout as maxtext
from hybridckpt.formats.maxtext.layout import NAME, detect, steps  # noqa: F401  (the reader registry's entry points)
from hybridckpt.lazy import LazyTensor

V1_PYTREE_HANDLER = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"


def open(path: str, *, config: Any = None, step: int | None = None):  # noqa: A001
    """A MaxText checkpoint as a lazy `SourceCheckpoint`: params (and Adam's mu/nu, the step)
    under MaxText's names with the layer axis first; the family's rules take them to HF names
    (the query kernel scaled back, RoPE rows as HF's; the moments with `Op.for_slot`). MaxText
    saves no model config: with `config` (`--config`, an HF config.json) it is read as that model;
    without, its tensors are listed and converted under MaxText's names (layer axis first), as
    any source without a config."""
    from hybridckpt.containers.orbax.reader import item_arrays, scalar_int
    from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint

    item_dir, dir_step = maxtext.item_dir(path, step)
    leaves = item_arrays(item_dir)
    cycle = maxtext.layer_cycle(config) if config is not None else None
    layers = int(config.num_layers) if cycle is not None else 0
    groups = maxtext.scan_groups(config) if cycle is not None else None
    axis0 = maxtext.layer_axis_0(config) if config is not None else ()

    def under(prefix: str) -> dict[str, LazyTensor]:
        return maxtext.from_disk({k[len(prefix):]: v for k, v in leaves.items() if k.startswith(prefix)}, item_dir,
                                 cycle, layers, groups, axis0=axis0)

    params = under(maxtext.PARAMS)
    if not params:
        raise FormatError(f"{item_dir}: no arrays under {maxtext.PARAMS!r}")
    run_step = scalar_int(leaves[maxtext.STEP], maxtext.STEP, item_dir) if maxtext.STEP in leaves else dir_step
    optimizer = None
    slots = {slot: under(prefix) for slot, prefix in maxtext.SLOTS.items()}
    if any(slots.values()):
        missing = [s for s, t in slots.items() if set(t) != set(params)]
        if missing:
            raise CheckpointError(f"{item_dir}: Adam's {missing} do not cover the params")
        count = scalar_int(leaves[maxtext.ADAM_COUNT], maxtext.ADAM_COUNT, item_dir) if maxtext.ADAM_COUNT in leaves else run_step
        optimizer = OptimizerState(slots, count)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=params,
        optimizer=optimizer,
        hf_rules=maxtext.dialect(config).rules()[0] if config is not None else "",
        rule_vars=maxtext.rule_vars(config) if config is not None else {},
        config=config,
        step=optimizer.step if optimizer is not None else run_step,
        notes=tuple(maxtext.notes(config)) if config is not None else (
            "MaxText records no model config: its tensors under MaxText's names, the layer axis first "
            "(--config, an HF config.json, reads it as that model)",),
    )


def _leaves(tree: Any, mesh) -> Any:
    """Lazy tensors -> `stream.LazyLeaf`s (replicated on `mesh`, a scanned array chunked one
    layer at a time); ints -> int32 scalars, lazy leaves as well.

    Every leaf of the item goes through one Orbax type handler (`stream_orbax.LazyArrayHandler`):
    two handlers of one save (a step counter placed as a `jax.Array` went to Orbax's own) each
    record their arrays in the item's `array_metadatas/process_0` by a read-modify-write with an
    await between the read and the write, in one event loop; the later write lost the other's
    records and Orbax's commit failed with "No ArrayMetadata found for param_info" (the seventh
    stop's CI, `test_stored_dtypes.py[maxtext]`, on a loaded machine)."""
    import jax
    import numpy as np

    from hybridckpt.lazy.stored import ArrayTensor
    from hybridckpt.store.stream import LazyLeaf, StreamOptions

    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opts = StreamOptions()

    def one(path, x):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if isinstance(x, int):  # (a step counter: a lazy leaf too, so one handler writes the item; see below)
            return LazyLeaf(ArrayTensor(np.asarray(x, np.int32)), sharding, name=name, options=opts)
        stacked = any(f".{s}" in f".{name}" for s in maxtext.STACKS) and x.ndim > maxtext.SCAN_AXIS
        return LazyLeaf(x, sharding, name=name, chunk_axes=(maxtext.SCAN_AXIS,) if stacked else (), options=opts)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, (int, LazyTensor)))


def save_state(out_dir: str, step: int, tree: Any, *, scan_layers: bool, mesh=None) -> None:
    """Write the train state `tree` (nested dicts and lists of LazyTensors, ints, None) as
    `out_dir/<step>/items`, streamed, with the step's `_CHECKPOINT_METADATA` naming Orbax's v1
    PyTreeHandler for `items` and `scan_layers` as MaxText's Checkpointer writes them (maxtext
    0.2.5 common/checkpointing.py `save_checkpoint`). `mesh`: where the arrays are placed
    (default: every device, replicated: each chunk written once)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from hybridckpt.store.orbax_io import standard_save
    from hybridckpt.store.stream_orbax import StreamingCheckpointHandler

    mesh = mesh or jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    leaves = _leaves(tree, mesh)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(maxtext.ITEM, ocp.args.StandardSave, StreamingCheckpointHandler())
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(out_dir, options=options, handler_registry=registry) as manager:
        manager.save(step, args=ocp.args.Composite(**{maxtext.ITEM: standard_save(leaves)}), force=True)
        manager.wait_until_finished()
    meta_path = Path(out_dir) / str(step) / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta["item_handlers"] = {maxtext.ITEM: V1_PYTREE_HANDLER}
    meta["custom_metadata"] = {"scan_layers": bool(scan_layers)}
    meta_path.write_text(json.dumps(meta))
