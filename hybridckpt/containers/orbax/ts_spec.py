"""TensorStore specs and contexts for reading an array of our Orbax items, on TensorStore's own API.

What Orbax 0.12's `tensorstore_utils.build_array_read_spec` / `get_ts_context` build for a
local checkpoint (google/orbax:checkpoint/orbax/checkpoint/_src/serialization/
tensorstore_utils.py), written here against TensorStore's public JSON spec so that reading our
store depends on no Orbax internals (`tests/store/test_orbax_private.py` compares the two):

- an item saved without OCDBT keeps each array in its own folder: `{"driver": "zarr" | "zarr3",
  "kvstore": {"driver": "file", "path": "<item>/<name>"}}`;
- an OCDBT item is one database: `{"driver": "ocdbt", "base": <the item folder, file driver,
  non-atomic data files>, "manifest": <the same folder, atomic>, "path": "<name>",
  "cache_pool": "cache_pool#ocdbt"}` (the per-process sub-databases a multi-process save merges
  are found through the root manifest);
- an item in a bucket (a folder of `io.remote.view`) is read from the bucket itself: the `file`
  kvstores above become the URL's kvstore (`io.remote.ts_kvstore.for_local`: `s3`, `gcs`, the
  endpoint named), never the view's placeholders;
- reads never fill missing chunks (`fill_missing_data_reads: false`: a missing chunk is an
  error, as in Orbax) and cached data is not rechecked (a store is written once).
"""

from __future__ import annotations

import os

from hybridckpt.io.remote import ts_kvstore

OCDBT_CACHE_BYTES = 100_000_000  # Orbax's default OCDBT B-tree node cache
CHUNK_CACHE_BYTES = 64 << 20  # decoded chunks of a compressed item, kept for the next box that needs them
FILE_IO_CONCURRENCY = 128  # Orbax's default


def read_spec(item_dir: str, name: str, *, use_ocdbt: bool, use_zarr3: bool = False) -> dict:
    """The TensorStore spec that opens array `name` of the item at `item_dir` for reading."""
    folder = os.path.abspath(item_dir)
    remote = ts_kvstore.for_local(folder)
    if use_ocdbt:
        base = remote or {"driver": "file", "path": folder.rstrip("/") + "/"}
        kvstore = {
            "driver": "ocdbt",
            "base": base if remote else {**base, "file_io_locking": {"mode": "non_atomic"}},
            "manifest": base,
            "path": name,
            "cache_pool": "cache_pool#ocdbt",
        }
    elif remote:
        kvstore = {**remote, "path": remote["path"] + name + "/"}
    else:
        kvstore = {"driver": "file", "path": os.path.join(folder, name)}
    return {
        "driver": "zarr3" if use_zarr3 else "zarr",
        "kvstore": kvstore,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": False,
    }


def context(*, use_ocdbt: bool):
    """A TensorStore context like Orbax's: bounded file I/O concurrency, an OCDBT node cache; and,
    for an OCDBT (compressed) item, a cache of its decoded chunks (`CHUNK_CACHE_BYTES`): a stored
    chunk that two devices' boxes share (a restore onto another mesh) is fetched once, not once a
    device. Without it (TensorStore's default pool holds nothing) the second box's read fetched the
    chunk again whenever the first read had already finished: a restore from a bucket asked the
    server for ~2x the chunks' bytes on a loaded machine, 1x when the reads happened to overlap."""
    import tensorstore as ts

    spec: dict = {"file_io_concurrency": {"limit": FILE_IO_CONCURRENCY}}
    if use_ocdbt:
        spec["cache_pool#ocdbt"] = {"total_bytes_limit": OCDBT_CACHE_BYTES}
        spec["cache_pool"] = {"total_bytes_limit": CHUNK_CACHE_BYTES}
    return ts.Context(spec)
