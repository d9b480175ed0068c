"""Our own store and MaxText checkpoints read as the untrusted sources they are (issue 38).

Each hostile store is a real import (a model-agnostic one: its leaves keep the source's names)
or MaxText's own save (`tests/real/cases/maxtext_llama3`) whose metadata the test then edits as
an attacker would: a leaf named by an absolute path or `../x`, two leaves of one name, a
recorded `tensor_names` entry that makes two leaves one tensor, a deleted CRC table beside the
import's other records, a FIFO named like a chunk. A sentinel array outside the store holds
values no real leaf has (`SENTINEL`): a command that read it would show them. Every case is one
line and exit 2 through the CLI, with nothing written.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest
from attacks.hostile import make_world, tree_digest, unknown_arch_folder
from test_hostile import cli, one_line

import hybridckpt
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import HybridCkptError
from hybridckpt.formats import orbax_store as as_source

SENTINEL = 12345.0  # the value of every element of the array planted outside the store
ODD = "a/b"  # a source name that is not plain: stored under an escaped key
TENSORS = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "up": np.arange(64, dtype=np.float32) * -2,
           ODD: np.full((4,), 3.0, np.float32)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A model-agnostic import of `TENSORS` (a real `hybridckpt import`, CRC tables recorded)."""
    root = tmp_path_factory.mktemp("untrusted")
    unknown_arch_folder(str(root / "src"), TENSORS)
    hybridckpt.import_checkpoint(str(root / "src"), str(root / "ck"))
    return str(root / "ck")


def _world(store: str, tmp_path):
    """(world, its copy of the store, the step folder): `outside/secret` is the store's `up`
    array with every element `SENTINEL`, a valid array folder a hostile name could point at."""
    w = make_world(tmp_path)
    copy = os.path.join(w.root, "ck")
    shutil.copytree(store, copy)
    step = glob.glob(os.path.join(copy, "*", "params"))[0].rsplit(os.sep, 1)[0]
    secret = os.path.join(w.outside, "secret")
    shutil.copytree(os.path.join(step, "params", "up"), secret)
    for chunk in glob.glob(os.path.join(secret, "[0-9]*")):
        n = os.path.getsize(chunk) // 4
        np.full(n, SENTINEL, "<f4").tofile(chunk)
    return w, copy, step


def _edit_json(path: str, edit) -> None:
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def _rename_leaf(meta: dict, old: str, keys: list[str]) -> None:
    tree = meta["tree_metadata"]
    label = next(k for k, e in tree.items() if ".".join(str(x["key"]) for x in e["key_metadata"]) == old)
    entry = tree.pop(label)
    entry["key_metadata"] = [{"key": k, "key_type": 2} for k in keys]
    tree[f"hostile {keys!r}"] = entry


def _drop_records(state: dict, keys=("chunk_crc32", "checksums", "checksum_chunks", "checksum_algorithm", "array_specs")):
    for k in keys:
        state.pop(k, None)


def _refused(capsys, src: str, tmp_path, *must: str, extra=()) -> None:
    """`inspect` and `export` of `src` are one line each, exit 2, and nothing is written."""
    code, _, err = cli(capsys, "inspect", src, *extra)
    one_line(code, err, *must)
    out = os.path.join(tmp_path, "out")
    code, _, err = cli(capsys, "export", src, out, *extra)
    one_line(code, err, *must)
    assert not os.path.exists(out)


def _exported(capsys, src: str, tmp_path, *extra) -> dict[str, np.ndarray]:
    out = os.path.join(tmp_path, "out")
    shutil.rmtree(out, ignore_errors=True)
    code, _, err = cli(capsys, "export", src, out, *extra)
    assert code == 0, err
    return {k: v.materialize() for k, v in read_header(os.path.join(out, "model.safetensors")).tensors.items()}


def test_the_untouched_store_exports_exactly(store, tmp_path, capsys):
    """The control: every test below edits this store; as imported it gives its tensors back."""
    got = _exported(capsys, store, tmp_path)
    assert sorted(got) == sorted(TENSORS)
    for k, v in TENSORS.items():
        assert np.array_equal(got[k], v)


@pytest.mark.parametrize("tables", [True, False], ids=["with-crc-tables", "no-records"])
@pytest.mark.parametrize("key", ["absolute", "dotdot", "nested"])
def test_a_leaf_named_by_a_path_is_refused_and_nothing_outside_is_read(store, tmp_path, capsys, key, tables):
    """`_METADATA` naming the leaf `up` by a path to the sentinel array (absolute, or `../..`
    from the item): refused before anything is opened, with the CRC tables or without them."""
    w, copy, step = _world(store, tmp_path)
    name = {"absolute": os.path.join(w.outside, "secret"),
            "dotdot": os.path.relpath(os.path.join(w.outside, "secret"), os.path.join(step, "params")),
            "nested": "up/../../../../outside/secret"}[key]
    _edit_json(os.path.join(step, "params", "_METADATA"), lambda m: _rename_leaf(m, "up", [name]))
    if not tables:
        _edit_json(os.path.join(step, "trainer_state", "metadata"), _drop_records)
    before = tree_digest(w.outside)
    _refused(capsys, copy, tmp_path, "_METADATA", "one folder inside the item")
    code, _, err = cli(capsys, "export", copy, tmp_path / "out", "--no-verify-reads")
    one_line(code, err, "_METADATA")
    with pytest.raises(HybridCkptError, match="one folder inside"):
        as_source.open(copy, verify_reads=False)
    assert tree_digest(w.outside) == before and w.leftovers() == ["ck"]


@pytest.mark.parametrize("how", ["same-keys", "dotted-parts"])
def test_two_leaves_of_one_name_are_refused(store, tmp_path, capsys, how):
    """Two `_METADATA` leaves whose joined names are one (`up` twice; `w.x` from keys
    ["w", "x"] and ["w.x"]): one array would be read for both."""
    _, copy, step = _world(store, tmp_path)

    def edit(meta):
        if how == "same-keys":
            _rename_leaf(meta, "w", ["up"])  # (two entries, labelled apart, both keyed ["up"])
        else:
            _rename_leaf(meta, "w", ["up", "x"])
            _rename_leaf(meta, "up", ["up.x"])

    _edit_json(os.path.join(step, "params", "_METADATA"), edit)
    _refused(capsys, copy, tmp_path, "_METADATA", "the same name")


def test_two_leaves_that_are_one_folder_are_refused(store, tmp_path, capsys):
    """Names equal but for case are two folders here and one on a case-blind filesystem (a
    link `W` -> `w` stands for one): refused, not read twice."""
    _, copy, step = _world(store, tmp_path)
    params = os.path.join(step, "params")
    os.symlink("w", os.path.join(params, "W"))

    def edit(meta):
        tree = meta["tree_metadata"]
        entry = json.loads(json.dumps(next(e for e in tree.values() if e["key_metadata"][0]["key"] == "w")))
        entry["key_metadata"] = [{"key": "W", "key_type": 2}]
        tree["('W',)"] = entry

    _edit_json(os.path.join(params, "_METADATA"), edit)
    _edit_json(os.path.join(step, "trainer_state", "metadata"), _drop_records)
    _refused(capsys, copy, tmp_path, "one folder on this filesystem")


@pytest.mark.parametrize("how", ["hides-a-leaf", "wrong-key"])
def test_a_recorded_name_that_hides_another_leaf_is_refused(store, tmp_path, capsys, how):
    """`trainer_state["tensor_names"]` gives the escaped leaf of `a/b` the name `w` (two leaves,
    one tensor: today `w` is exported with `a/b`'s values), or records it under another key."""
    _, copy, step = _world(store, tmp_path)

    def edit(state):
        names = state["tensor_names"]
        key = next(k for k, v in names.items() if v == ODD)
        if how == "hides-a-leaf":
            names[key] = "w"
        else:
            names[key[:-1] + ("0" if key[-1] != "0" else "1")] = names.pop(key)

    _edit_json(os.path.join(step, "trainer_state", "metadata"), edit)
    if how == "hides-a-leaf":
        _refused(capsys, copy, tmp_path, "tensor_names", "'w'")
    else:  # an unknown escaped key keeps its key as its name: exported under it, nothing lost
        got = _exported(capsys, copy, tmp_path)
        assert len(got) == len(TENSORS) and np.array_equal(got["w"], TENSORS["w"])
    if how == "hides-a-leaf":
        with pytest.raises(HybridCkptError, match="tensor_names"):
            as_source.open(copy)


def _flip_a_chunk(step: str, array: str = "w") -> None:
    chunk = sorted(glob.glob(os.path.join(step, "params", array, "[0-9]*")))[0]
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(chunk, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["deleted", "not-an-object"])
def test_a_crc_table_removed_beside_the_other_records_is_refused(store, tmp_path, capsys, how):
    """A flipped chunk and the CRC table deleted (or replaced) while `checksums` and the other
    import records stay: every read refuses unless told not to check; told, it reads as stored."""
    _, copy, step = _world(store, tmp_path)
    _flip_a_chunk(step)
    _edit_json(os.path.join(step, "trainer_state", "metadata"),
               lambda s: s.pop("chunk_crc32") if how == "deleted" else s.update(chunk_crc32="AAAA"))
    out = os.path.join(tmp_path, "out")
    code, _, err = cli(capsys, "export", copy, out)
    one_line(code, err, "chunk_crc32", "--no-verify-reads")
    assert not os.path.exists(out)
    code, _, err = cli(capsys, "logits", copy, "--tokens", "1,2")
    one_line(code, err)
    with pytest.raises(HybridCkptError, match="chunk_crc32"):
        hybridckpt.restore(copy, "dp=1")
    got = _exported(capsys, copy, tmp_path, "--no-verify-reads")
    assert not np.array_equal(got["w"], TENSORS["w"]) and np.array_equal(got["up"], TENSORS["up"])


@pytest.mark.parametrize("shape", [None, 8, "8"], ids=["null", "int", "string"])
def test_a_recorded_array_spec_whose_shape_is_not_a_list_is_refused(store, tmp_path, capsys, shape):
    """Found by `benchmarks/fuzz.py --seed 9002` (target 'our store trainer_state'): a `shape`
    of null in `array_specs` was a TypeError ('NoneType' object is not iterable)."""
    _, copy, step = _world(store, tmp_path)

    def edit(state):
        for spec in state["array_specs"].values():
            spec["shape"] = shape
    _edit_json(os.path.join(step, "trainer_state", "metadata"), edit)
    out = os.path.join(tmp_path, "out")
    code, _, err = cli(capsys, "export", copy, out)  # (inspect reads no array: exits 0)
    one_line(code, err, "'array_specs' of array", "'shape' expected a list of sizes, found")
    assert not os.path.exists(out)


def test_a_store_with_no_import_records_is_read_as_saved(store, tmp_path, capsys):
    """A step with none of an import's records (a training loop's save) has nothing to check
    against: it is read as saved, not refused."""
    _, copy, step = _world(store, tmp_path)
    _edit_json(os.path.join(step, "trainer_state", "metadata"), _drop_records)
    got = _exported(capsys, copy, tmp_path)
    assert all(np.array_equal(got[k], v) for k, v in TENSORS.items())


def test_a_fifo_named_like_a_chunk_is_refused_not_waited_on(store, tmp_path, capsys):
    """A FIFO where a chunk file (or a `.zarray`) lies: TensorStore would block on it forever."""
    _, copy, step = _world(store, tmp_path)
    meta = os.path.join(step, "params", "up", ".zarray")
    os.remove(meta)
    os.mkfifo(meta)
    _refused(capsys, copy, tmp_path, "not a regular file")


# -- MaxText ----------------------------------------------------------------------------------------

CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real", "cases")
MAXTEXT = os.path.join(CASES, "maxtext_llama3", "ckpt")  # MaxText 0.2.5's own save (tests/real/README.md)
CONFIG = os.path.join(CASES, "torchtitan_llama3", "config.json")
SCALE = "params.params.decoder.decoder_norm.scale"


def _maxtext_world(tmp_path):
    """(world, the copy of MaxText's checkpoint, its items folder); `outside/secret` is the norm
    scale's array with every element `SENTINEL`."""
    w = make_world(tmp_path)
    copy = os.path.join(w.root, "mx")
    shutil.copytree(MAXTEXT, copy)
    items = glob.glob(os.path.join(copy, "*", "items"))[0]
    secret = os.path.join(w.outside, "secret")
    shutil.copytree(os.path.join(items, SCALE), secret)
    for chunk in glob.glob(os.path.join(secret, "[0-9]*")):
        np.full(os.path.getsize(chunk) // 4, SENTINEL, "<f4").tofile(chunk)
    return w, copy, items


@pytest.mark.parametrize("leaf", [SCALE, "step"])
def test_a_maxtext_leaf_named_by_a_path_is_refused(tmp_path, capsys, leaf):
    """MaxText's `_METADATA` naming a leaf (a param; the step, read at open) by the absolute path
    of the sentinel array: today `step` is read from outside and the export goes on."""
    w, copy, items = _maxtext_world(tmp_path)
    _edit_json(os.path.join(items, "_METADATA"), lambda m: _rename_leaf(m, leaf, [os.path.join(w.outside, "secret")]))
    _refused(capsys, copy, tmp_path, "_METADATA", "one folder inside the item", extra=("--config", CONFIG))


def test_a_maxtext_checkpoint_with_two_leaves_of_one_name_is_refused(tmp_path, capsys):
    _, copy, items = _maxtext_world(tmp_path)
    _edit_json(os.path.join(items, "_METADATA"),
               lambda m: _rename_leaf(m, "opt_state.2.count", ["params", "params.decoder.decoder_norm", "scale"]))
    _refused(capsys, copy, tmp_path, "the same name", extra=("--config", CONFIG))


def test_a_maxtext_fifo_named_like_a_chunk_is_refused(tmp_path, capsys):
    _, copy, items = _maxtext_world(tmp_path)
    meta = os.path.join(items, "step", ".zarray")
    os.remove(meta)
    os.mkfifo(meta)
    _refused(capsys, copy, tmp_path, "not a regular file", extra=("--config", CONFIG))



@pytest.mark.parametrize("shape", [[2], [1, 3]])
def test_a_maxtext_step_that_is_not_one_integer_is_refused(tmp_path, capsys, shape):
    """MaxText's `step` leaf rewritten as a raw int32 array of several elements (a valid array
    whose chunk is all there): one line naming it, checked on its declared shape, not a
    TypeError from converting the array read whole."""
    _, copy, items = _maxtext_world(tmp_path)
    folder = os.path.join(items, "step")
    _edit_json(os.path.join(folder, ".zarray"), lambda z: z.update(shape=shape, chunks=shape, compressor=None))
    os.remove(os.path.join(folder, "0"))
    np.arange(int(np.prod(shape)), dtype="<i4").tofile(os.path.join(folder, ".".join("0" * len(shape))))
    _refused(capsys, copy, tmp_path, "step", "expected one integer", extra=("--config", CONFIG))


def test_an_index_naming_a_data_file_outside_is_not_handed_to_tensorstore(store, tmp_path, monkeypatch):
    """An OCDBT index whose value reference leaves the item (`parse_location` refuses it) must
    stop the read: it was taken for an unreadable index and the array read through TensorStore,
    which follows the same reference."""
    from hybridckpt.containers.orbax import chunk_index, reader

    with pytest.raises(HybridCkptError, match="only a path inside"):
        chunk_index.parse_location(str(tmp_path), "value::../../outside/secret:0:16")

    def outside(item_dir, context=None):
        return chunk_index.parse_location(item_dir, "value::../../outside/secret:0:16")

    monkeypatch.setattr(reader, "read_index", outside)
    _, copy, step = _world(store, tmp_path)
    with pytest.raises(HybridCkptError, match="only a path inside"):
        reader.item_arrays(os.path.join(step, "params"))
