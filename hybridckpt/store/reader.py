"""Arrays of an Orbax checkpoint as LazyTensors: a box read reads only the chunks covering it.

Layout read (see `hybridckpt.store.layout`): `DIR/<step>/<item>/` is one Orbax pytree item
(`params`, `opt_state`) in OCDBT format; its `_METADATA` names every leaf (the dotted key path,
e.g. `layers.q.kernel`, `0.mu.layers.q.kernel`) and says whether arrays are zarr v2 or v3. Each
array is a zarr array at that name inside the item's OCDBT database, opened with Orbax's own
read spec (`tensorstore_utils.build_array_read_spec`, orbax-checkpoint 0.12.8), so a box read
fetches and decompresses only the chunks it overlaps (a stacked `[layers, ...]` leaf saved by
`hybridckpt import` is chunked per layer: one layer read = one layer's chunks).

This is how every job reads our store (`store.source`): `export` streams: one HF tensor in memory at a time,
instead of restoring the whole tree onto one device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import tensorstore as ts
from etils import epath
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import types as ts_types

from hybridckpt.errors import CheckpointError
from hybridckpt.formats.config_file import read_json
from hybridckpt.lazy import Box, LazyTensor


@dataclass(frozen=True, eq=False)
class OrbaxArray(LazyTensor):
    """Leaf `name` of the Orbax item at `item_dir`: global `shape` and `dtype` as saved."""

    item_dir: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    use_zarr3: bool = False
    context: ts.Context | None = field(default=None, repr=False)  # one per opened item
    _store: list = field(default_factory=list, repr=False)  # the opened TensorStore, once

    def _open(self) -> ts.TensorStore:
        if not self._store:
            info = ts_types.ParamInfo(
                name=self.name,
                parent_dir=epath.Path(self.item_dir),
                is_ocdbt_checkpoint=True,
                use_zarr3=self.use_zarr3,
                ts_context=self.context,
            )
            spec = ts_utils.build_array_read_spec(info, use_ocdbt=True).json
            try:
                store = ts.open(ts.Spec(spec), open=True, context=self.context).result()
            except ValueError as e:
                raise CheckpointError(f"{self.item_dir}: cannot open array {self.name}: {_reason(e)}") from e
            self._store.append(store)
        return self._store[0]

    def read_box(self, box: Box) -> np.ndarray:
        index = tuple(slice(a, b) for a, b in box)
        try:
            out = self._open()[index].read().result()
        except ValueError as e:
            raise CheckpointError(f"{self.item_dir}: cannot read {self.name}{list(box)}: {_reason(e)}") from e
        out = np.asarray(out, dtype=self.dtype)
        return out if out.flags.c_contiguous else out.copy()  # (ascontiguousarray makes 0-d 1-d)


def _reason(e: Exception) -> str:
    """TensorStore's error without the spec it appends (a JSON document of a few hundred bytes)."""
    text = str(e).split(" [source locations=")[0].split(" [tensorstore_spec=")[0]
    return " ".join(text.split())[:300]


@dataclass(frozen=True)
class UnreadableArray:
    """An array of the item whose metadata or index cannot be read (`item_arrays(...,
    unreadable="keep")`): its name and the reason, for a report that goes on."""

    name: str
    reason: str


def item_arrays(item_dir: str, *, unreadable: str = "raise") -> dict[str, OrbaxArray]:
    """Every array leaf of the Orbax item at `item_dir`, by its dotted name (from `_METADATA`
    for the names and zarr version, the zarr metadata for shape and dtype; no data read).

    unreadable: "raise" (a CheckpointError naming the array) or "keep" (an `UnreadableArray` in
    its place, for `verify` to report every damaged array rather than stop at the first).
    """
    meta = read_json(os.path.join(item_dir, "_METADATA"))
    zarr3 = bool(meta.get("use_zarr3", False))
    out: dict[str, OrbaxArray] = {}
    # a context (and so a chunk cache) per opened item: a later open sees what is on disk now,
    # never chunks cached from an earlier write or read of the same path in this process
    context = ts_utils.get_ts_context(use_ocdbt=True)
    for entry in meta.get("tree_metadata", {}).values():
        value = entry.get("value_metadata", {})
        if value.get("value_type") not in ("jax.Array", "np.ndarray"):
            continue
        name = ".".join(str(k["key"]) for k in entry.get("key_metadata", []))
        probe = OrbaxArray(item_dir, name, (), np.dtype(np.float32), zarr3, context)
        try:
            store = probe._open()
        except CheckpointError as e:
            if unreadable != "keep":
                raise
            out[name] = UnreadableArray(name, str(e).split(f"array {name}: ", 1)[-1][:160])
            continue
        out[name] = OrbaxArray(
            item_dir, name, tuple(int(n) for n in store.shape), np.dtype(store.dtype.numpy_dtype), zarr3,
            context, probe._store,
        )
    return out
