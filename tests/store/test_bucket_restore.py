"""`store.bucket_restore`: the metadata tree `restore()` of a store in a bucket builds instead of
asking Orbax (issue 43; the bucket itself: tests/remote/test_restore_ocdbt_bucket.py). It equals
Orbax's own tree of the same item (a training loop's OCDBT save: dicts, an optimizer's list with
empty slots), and `_METADATA`'s key paths, untrusted, are nested under bounds.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from meshes import fit

from hybridckpt.errors import CheckpointError
from hybridckpt.mesh import as_mesh
from hybridckpt.store import bucket_restore
from hybridckpt.store.manager import CheckpointStore
from hybridckpt.store.orbax_io import as_shape_dtype, item_metadata

S, D = bucket_restore.SEQUENCE, bucket_restore.DICT


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A training loop's save (Orbax's OCDBT + zstd defaults) of params and AdamW's state."""
    mesh = as_mesh(fit("fsdp=2"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    params = {"w": jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4), sharding),
              "b": {"x": jnp.ones((3,), jnp.bfloat16)}}
    opt = optax.adamw(1e-3).init(params)
    folder = tmp_path_factory.mktemp("loop") / "ck"
    with CheckpointStore(folder) as store:
        store.save(5, params, opt)
    assert (folder / "5" / "params" / "manifest.ocdbt").is_file()  # OCDBT, as Orbax saves by default
    return folder


def test_the_tree_equals_orbax_own_metadata(saved):
    with CheckpointStore(saved) as store:
        for item in ("params", "opt_state"):
            want = as_shape_dtype(item_metadata(store._manager, 5, item))
            got = bucket_restore.open_item(str(saved / "5" / item)).tree
            assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
            assert jax.tree.leaves(got) == jax.tree.leaves(want) and jax.tree.leaves(got)
    assert bucket_restore.open_item(str(saved / "5" / "absent")) is None


def test_nesting_lists_dicts_and_empty_slots():
    flat = [([("0", S), ("mu", D)], 1), ([("2", S)], None), ([("1", S), ("a", D)], 2)]
    assert bucket_restore.nest(flat, "m") == [{"mu": 1}, {"a": 2}, None]
    assert bucket_restore.nest([([("0", S)], 7)], "m") == [7]


@pytest.mark.parametrize("flat, problem", [
    ([([("999999999", S)], 1)], "not below the 1 leaves"),  # no list grown to a hostile index
    ([([("-1", S)], 1), ([("0", S)], 2)], "not below"),
    ([([("a", D)], 1), ([("a", D), ("b", D)], 2)], "both a leaf and a node"),
    ([([("a", D)], 1), ([("a", D)], 2)], "listed twice"),
    ([([("0", S)], 1), ([("a", D)], 2)], "not a dict"),
    ([([("0", S)], 1), ([("0", S)], 2)], "listed twice"),
    ([([("a", D)], 1), ([("b", 7)], 2)], "does not fit"),
])
def test_hostile_key_paths_are_one_line(flat, problem):
    with pytest.raises(CheckpointError, match=problem) as e:
        bucket_restore.nest(flat, "/x/_METADATA")
    assert "\n" not in str(e.value) and "/x/_METADATA" in str(e.value)


def test_a_leaf_only_orbax_reads_is_refused(saved, tmp_path):
    import shutil

    item = tmp_path / "params"
    shutil.copytree(saved / "5" / "params", item)
    meta = json.loads((item / "_METADATA").read_text())
    meta["tree_metadata"]["('lr',)"] = {"key_metadata": [{"key": "lr", "key_type": D}],
                                        "value_metadata": {"value_type": "scalar", "skip_deserialize": False}}
    (item / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="'lr' is a 'scalar', not an array"):
        bucket_restore.open_item(str(item))
