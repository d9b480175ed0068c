"""A `CheckpointStore.save` item is written by one Orbax type handler: a tree mixing the streaming
save's `stream.LazyLeaf`s with `jax.Array`s is refused, naming the item, before anything is written.

Each of the two handlers (ours, `stream_orbax.LazyArrayHandler`, and Orbax's own `ArrayHandler`)
records its arrays in the item's `array_metadatas/process_0` by a read-modify-write with an await
between the read and the write (orbax `array_metadata_store.Store.write`), in one event loop: the
later write dropped the other's records and Orbax's commit failed ("No ArrayMetadata found for
..."; the MaxText export's step counters hit it, 40292ab). No caller builds such a tree; wrapping
the arrays as lazy leaves instead would leave their CRC-32s out of the tables a caller records
from its own leaves (`jobs.import_`), so the mix is an error. Forced here as in
`tests/jobs/test_maxtext_one_handler.py`: the record's existence check yields a while."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from fixtures.orbax_records import slow_record_checks

from hybridckpt.errors import ConfigError
from hybridckpt.lazy.stored import ArrayTensor
from hybridckpt.store.manager import CheckpointStore
from hybridckpt.store.stream import LazyLeaf


@pytest.fixture
def slow_records(monkeypatch):
    slow_record_checks(monkeypatch)


def _trees():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int32) - 2
    return a, b, (lambda x, name: LazyLeaf(ArrayTensor(x), sharding, name=name)), (lambda x: jax.device_put(x, sharding))


def test_a_tree_mixing_lazy_leaves_and_arrays_is_refused_naming_the_item(tmp_path, slow_records):
    a, b, lazy, array = _trees()
    with CheckpointStore(tmp_path / "ck", async_save=False) as store, \
            pytest.raises(ConfigError, match=r"/opt_state: mixes .*count, mu\.a.*jax\.Arrays \(mu\.b\)"):
        store.save(1, {"a": array(a)}, {"mu": {"a": lazy(a, "mu.a"), "b": array(b)}, "count": lazy(b, "count")})
    assert os.listdir(tmp_path / "ck") == []  # nothing written, the params' item neither


@pytest.mark.parametrize("kind", ["lazy", "arrays", "lazy+numpy"])
def test_one_kind_an_item_saves_and_restores_as_given(tmp_path, slow_records, kind):
    """(A numpy array goes to Orbax's NumpyHandler, which records no array metadata: allowed.)"""
    a, b, lazy, array = _trees()
    tree = {"lazy": {"a": lazy(a, "a"), "b": lazy(b, "b")}, "arrays": {"a": array(a), "b": array(b)},
            "lazy+numpy": {"a": lazy(a, "a"), "b": b}}[kind]
    with CheckpointStore(tmp_path / "ck", async_save=False) as store:
        assert store.save(1, tree, force=True)
        targets = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
                   for k, x in (("a", a), ("b", b))}
        back = store.restore(1, target_params=targets).params
    assert np.asarray(back["a"]).tobytes() == a.tobytes() and np.asarray(back["b"]).tobytes() == b.tobytes()
