"""`export --to maxtext` records every array of its item: each of Orbax's type handlers in one save
records its arrays in the item's `array_metadatas/process_0` by a read-modify-write with an await
between the read and the write (orbax `array_metadata_store.Store.write`), so two handlers of one
save can lose each other's records, and Orbax's commit then fails with "No ArrayMetadata found for
param_info" (the seventh stop's CI: `test_stored_dtypes.py[maxtext]` on a loaded machine). The step
counters went to Orbax's own handler as `jax.Array`s, the rest to ours; now every leaf is ours.
The interleaving is forced here: the record's existence check yields a while, as under load."""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from fixtures.orbax_records import slow_record_checks

from hybridckpt.demo import sample_path
from hybridckpt.jobs.export import export_checkpoint
from hybridckpt.jobs.import_ import import_checkpoint


def test_one_handler_writes_the_item_and_every_array_is_recorded(tmp_path, monkeypatch):
    slow_record_checks(monkeypatch)
    orbax_own = ocp.type_handlers.get_type_handler(jax.Array)
    calls = []
    real_serialize = type(orbax_own).serialize

    async def counted(self, values, infos, args=None):
        calls.append(len(values))
        return await real_serialize(self, values, infos, args)

    monkeypatch.setattr(type(orbax_own), "serialize", counted)
    store, out = tmp_path / "store", tmp_path / "out"
    import_checkpoint(sample_path(), str(store), mesh="fsdp=1")
    calls.clear()
    export_checkpoint(str(store), str(out), to="maxtext", optimizer=True)
    assert calls == []  # not one leaf through Orbax's own handler
    step = next(d for d in os.listdir(out) if d.isdigit())
    with open(out / step / "items" / "array_metadatas" / "process_0") as f:
        recorded = {m["array_metadata"]["param_name"] for m in json.load(f)["array_metadatas"]}
    with open(out / step / "items" / "_METADATA") as f:
        tree = json.load(f)["tree_metadata"]  # every leaf of the item: its keys, its kind
    arrays = {".".join(k["key"] for k in v["key_metadata"]) for v in tree.values()
              if v["value_metadata"]["value_type"] != "None"}  # (optax's empty states: no array)
    assert recorded == arrays and len(arrays) > 10 and "opt_state.0.count" in arrays
