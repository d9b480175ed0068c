"""The arrays' codec of an import (`--compression`, raw by default), the raw-chunk reads through the
item's chunk index (a file per chunk for a raw import, the OCDBT index otherwise), and what stays
true of the checkpoint: plain Orbax restores it, bit for bit, and a
restore onto another mesh reads no more than one onto the saved mesh."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from meshes import fit, fit_mesh, fit_pair

from hybridckpt import jobs
from hybridckpt.cli import main
from hybridckpt.containers.orbax.chunk_index import read_index
from hybridckpt.containers.orbax.reader import item_arrays
from hybridckpt.demo import sample_path
from hybridckpt.io.byte_source import count_reads
from hybridckpt.jobs.restore import restore
from hybridckpt.mesh import MeshShape

MESH = fit("fsdp=2,tp=2,pp=2", keep="fsdp")  # fsdp splits the kernels' columns (the row runs below)


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """The sample imported with the default codec and with zstd level 3."""
    base = tmp_path_factory.mktemp("codec")
    out = {}
    for codec in (None, "zstd:3"):
        out[codec or "default"] = str(base / (codec or "default").replace(":", "-"))
        jobs.import_checkpoint(sample_path(), out[codec or "default"], mesh=MESH, compression=codec)
    return out


def _zarrays(ckpt: str, item: str = "params") -> dict:
    return read_index(os.path.join(ckpt, "12", item)).zarrays


def test_the_codec_is_recorded_in_every_zarray(imports):
    raw, zstd = _zarrays(imports["default"]), _zarrays(imports["zstd:3"])
    assert set(raw) == set(zstd) and "layers.q.kernel" in raw
    assert all(z["compressor"] is None for z in raw.values())
    assert all(z["compressor"] == {"id": "zstd", "level": 3} for z in zstd.values())
    # the same through TensorStore's own open of the array (what any zarr reader sees)
    arr = item_arrays(os.path.join(imports["zstd:3"], "12", "params"))["layers.q.kernel"]
    assert arr._open().spec().to_json()["metadata"]["compressor"] == {"id": "zstd", "level": 3}


def test_both_codecs_hold_the_same_values_bit_for_bit(imports):
    _, a = restore(imports["default"], "dp=1")
    _, b = restore(imports["zstd:3"], "dp=1")
    for tree_a, tree_b in ((a.params, b.params), (a.opt_state, b.opt_state)):
        la, lb = jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)
        assert len(la) == len(lb) > 10
        for x, y in zip(la, lb, strict=True):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert main(["verify", imports["default"]]) == 0  # equal to the source's import checksums


def test_plain_orbax_restores_the_raw_checkpoint_bit_for_bit(imports):
    """No hybridckpt on the read side: Orbax's StandardCheckpointer with the saved metadata only."""
    params_dir = os.path.join(imports["default"], "12", "params")
    with ocp.StandardCheckpointer() as ckptr:
        got = ckptr.restore(params_dir)
    ours = item_arrays(params_dir)
    flat = {".".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(got)[0]}
    assert set(flat) == set(ours)
    for name, arr in ours.items():
        assert np.asarray(flat[name]).tobytes() == arr.materialize().tobytes(), name


def test_raw_chunks_are_read_by_byte_range_and_only_the_box(imports):
    """A layer of a stacked kernel reads exactly its chunks' bytes (one layer of two); the zstd
    checkpoint has no raw chunks and reads through TensorStore (nothing counted here)."""
    arr = item_arrays(os.path.join(imports["default"], "12", "params"))["layers.down.kernel"]
    assert arr.raw() is not None and arr.shape[0] == 2  # (its 2 KiB chunks lie in data files)
    with count_reads() as reads:
        layer = arr.read_box(((1, 2), (0, arr.shape[1]), (0, arr.shape[2])))
    assert sum(v for k, v in reads.items() if isinstance(k, str)) == layer.nbytes == arr.nbytes // 2
    assert layer.tobytes() == np.asarray(arr._open()[1:2].read().result()).tobytes()
    zarr = item_arrays(os.path.join(imports["zstd:3"], "12", "params"))["layers.down.kernel"]
    box = ((1, 2), (0, arr.shape[1]), (0, arr.shape[2]))
    # the layer's C-order bytes: a run per row of each chunk it crosses (chunks split its columns)
    runs = arr.file_runs(box, 1000)
    assert runs and sum(r.nbytes for r in runs) == layer.nbytes
    if MeshShape.parse(MESH).fsdp > 1:  # 64 rows x column parts: more runs than 8, so no runs
        assert arr.file_runs(box, 8) is None
    else:  # one device: whole rows, a run per chunk
        assert arr.file_runs(box, 8) == runs
    assert zarr.raw() is None and zarr.file_runs(box, 1000) is None
    with count_reads() as reads:
        assert zarr.read_box(box).tobytes() == layer.tobytes()
    assert not reads


# One restore onto each mesh in a fresh process: the file bytes read around the second of two
# restores in a row (so B-tree nodes Orbax's context may keep from the first count the same for
# every mesh), by TensorStore's own counter (compressed chunks) plus hybridckpt's (raw chunk
# files, read by pread: `store.checked`). A fresh process: TensorStore's counter is process-wide,
# and in a test worker earlier tests' TensorStore activity and caches would be counted too.
_MEASURE = """
import sys, tensorstore as ts
from hybridckpt.io.byte_source import count_reads
from hybridckpt.jobs.restore import restore

def read():
    return sum(v["value"] for m in ts.experimental_collect_matching_metrics(
        "/tensorstore/kvstore/file/bytes_read") for v in m["values"])

for mesh in sys.argv[2:]:
    restore(sys.argv[1], mesh)
    before = read()
    with count_reads() as c:
        restore(sys.argv[1], mesh)
    print(mesh, read() - before + sum(v for k, v in c.items() if isinstance(k, str)))
"""


def _restore_bytes(ckpt: str, *meshes: str) -> dict[str, int]:
    """File bytes one restore of `ckpt` onto each of `meshes` reads (see `_MEASURE`)."""
    res = subprocess.run(
        [sys.executable, "-c", _MEASURE, ckpt, *meshes], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return {mesh: int(n) for mesh, n in (line.split() for line in res.stdout.splitlines())}


@pytest.mark.parametrize("codec", ["default", "zstd:3"])
def test_a_restore_onto_another_mesh_reads_no_more_than_onto_the_saved_one(imports, codec):
    """TensorStore's own count of file bytes read: onto the saved mesh, then onto meshes that cut
    every array differently. A chunk cut by a new shard boundary is read by both shards (TensorStore
    reads whole chunks, raw or compressed); on the sample, whose chunks are whole shards (under
    CHUNK_BYTES), that is the worst case: measured 1.05-1.11x (fsdp=4,tp=2) and 1.09-1.41x (tp=8),
    from run to run alike (a chunk two new shards need is read once or twice, as the second read
    finds it in TensorStore's cache or not; the same with chunk files as with OCDBT)."""
    ckpt = imports[codec]
    # on fewer devices the meshes of that form that differ from MESH (on one device: none)
    others = [m for m in dict.fromkeys(fit_pair(MESH, m)[1] for m in ("fsdp=4,tp=2", "tp=8")) if m != MESH]
    got = _restore_bytes(ckpt, MESH, *others)
    same = got[MESH]
    stored = sum(  # array data: OCDBT data files (zstd) or a raw import's chunk files
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(ckpt, "12")) for f in fs
        if os.path.basename(r) == "d" or (".zarray" in fs and not f.startswith("."))
    )
    assert stored > 0
    assert same >= stored * 0.5  # the counter sees the restore's reads
    for other in others:
        assert got[other] <= 1.5 * same, (other, got)


def test_a_bad_codec_is_one_line_before_anything_is_written(tmp_path, capsys):
    dst = tmp_path / "x"
    assert main(["import", sample_path(), str(dst), "--compression", "lz4", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compression 'lz4'" in err[0] and "zstd:LEVEL" in err[0]
    assert not dst.exists()


def test_our_store_is_exported_without_jax_or_orbax(imports, tmp_path):
    """Our store is read without JAX or Orbax (what keeps an export's memory in tens of MiB): a
    raw checkpoint through its chunk files alone, a zstd one through TensorStore's own API
    (`containers.orbax.ts_spec`); both exports write the same files."""
    code = (
        "import sys, json; from hybridckpt import jobs; jobs.export_checkpoint(sys.argv[1], sys.argv[2]); "
        "print(json.dumps(['jax' in sys.modules, 'orbax.checkpoint' in sys.modules]))"
    )
    outs = {}
    for codec in ("default", "zstd:3"):
        outs[codec] = str(tmp_path / codec.replace(":", "-"))
        res = subprocess.run([sys.executable, "-c", code, imports[codec], outs[codec]], capture_output=True,
                             text=True, check=True)
        loaded = json.loads(res.stdout.strip().splitlines()[-1])
        assert loaded == [False, False], (codec, loaded)
    for name in ("model.safetensors", "config.json"):
        with open(os.path.join(outs["default"], name), "rb") as a, open(os.path.join(outs["zstd:3"], name), "rb") as b:
            assert a.read() == b.read(), name


def test_raw_chunks_inside_ocdbt_are_still_read_through_its_index(tmp_path):
    """Imports before chunk files kept raw chunks inside the item's OCDBT database (what Orbax
    writes with `use_compression=False`): they are still read through the index, by pread (small
    chunks inline in B-tree nodes too), with neither JAX nor Orbax needed, bit for bit."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = fit_mesh("fsdp=2,tp=2,pp=2")
    rng = np.random.default_rng(3)
    vals = {"big": rng.standard_normal((64, 48)).astype(np.float32), "small": np.arange(6, dtype=np.float32)}
    arrays = {"big": jax.device_put(vals["big"], NamedSharding(mesh, P("fsdp", "tp"))),
              "small": jax.device_put(vals["small"], NamedSharding(mesh, P()))}
    item = str(tmp_path / "item")
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=False)) as ck:
        ck.save(item, args=ocp.args.PyTreeSave(arrays))
    assert os.path.exists(os.path.join(item, "manifest.ocdbt"))
    index = read_index(item)
    assert any(k.startswith("big/") for k in index.locations)  # stored by reference
    assert any(k.startswith("small/") for k in index.inline)  # 24 bytes: inline in a node
    got = item_arrays(item)
    for k, v in vals.items():
        assert got[k].raw() is not None, k  # the index's raw path, not TensorStore
        assert got[k].read_box(tuple((0, n) for n in v.shape)).tobytes() == v.tobytes(), k
    rows, cols = arrays["big"].sharding.shard_shape(vals["big"].shape)  # (32, 24) on 8 devices
    runs = got["big"].file_runs(((0, rows), (0, cols)), 8)  # a shard: byte ranges of the OCDBT data files
    assert runs and all("/d/" in r.source.path for r in runs) and sum(r.nbytes for r in runs) == rows * cols * 4
