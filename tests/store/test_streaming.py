"""Streaming import/export: tile-by-tile Orbax saves, bounded memory, parallel reads, lazy Orbax
sources. Every comparison is bitwise; no timing is asserted."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import fit, fit_mesh, fit_pair
from oracles import checksum_reference

from hybridckpt import checksum, jobs, lazy, models, naming, place
from hybridckpt.containers.safetensors_file import read_header as read_safetensors
from hybridckpt.demo import sample_path
from hybridckpt.errors import ConfigError
from hybridckpt.formats.hf.write import write_hf
from hybridckpt.io.byte_source import ByteSource
from hybridckpt.lazy import parallel
from hybridckpt.mesh import mesh_from_shape, tree_shardings
from hybridckpt.plan import abstract_tree
from hybridckpt.store import CheckpointStore, save_checkpoint, stream

RNG = np.random.default_rng(0)


# -- lazy views fill preallocated (and transposed) buffers -----------------------------------------


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Two [6, 10] fp32 pieces in one file, as StoredTensors, and their values."""
    a, b = RNG.standard_normal((6, 10)).astype(np.float32), RNG.standard_normal((6, 10)).astype(np.float32)
    path = tmp_path_factory.mktemp("stored") / "blob.bin"
    path.write_bytes(a.tobytes() + b.tobytes())
    src = ByteSource(str(path))
    return (lazy.StoredTensor(src, 0, (6, 10), np.dtype(np.float32)),
            lazy.StoredTensor(src, a.nbytes, (6, 10), np.dtype(np.float32)), a, b)


def test_read_into_fills_plain_and_transposed_buffers_like_read_box(stored):
    ta, tb, a, b = stored
    cat = lazy.concat([ta, tb], 0)  # [12, 10]
    views = {
        "concat": (cat, np.concatenate([a, b])),
        "transpose(concat)": (lazy.transpose(cat), np.concatenate([a, b]).T),
        "stack(transpose)": (lazy.Stack((lazy.transpose(ta), lazy.transpose(tb))), np.stack([a.T, b.T])),
        "unit reshape": (lazy.reshape(lazy.slice_axis(lazy.Stack((ta, tb)), 0, 1, 2), (6, 10)), b),
        "double transpose": (lazy.transpose(lazy.reshape(lazy.Stack((lazy.transpose(ta),)), (10, 6))), a),
        "cast bf16": (lazy.cast(lazy.transpose(cat), ml_dtypes.bfloat16), np.concatenate([a, b]).T.astype(ml_dtypes.bfloat16)),
        "take": (lazy.Take(cat, 0, (3, 1, 2, 0)), np.concatenate([a, b])[[3, 1, 2, 0]]),
    }
    for name, (t, want) in views.items():
        box = tuple((1, n - 1) for n in t.shape)
        region = tuple(slice(s, e) for s, e in box)
        assert np.array_equal(t.read_box(box), want[region]), name
        buf = np.full(lazy.box_shape(box)[::-1], np.nan, dtype=t.dtype)  # a transposed view to fill
        t.read_into(box, buf.T)
        assert np.array_equal(buf.T, want[region]), name
        plain = np.empty(t.shape, dtype=t.dtype)
        t.read_into(lazy.full_box(t.shape), plain)
        assert np.array_equal(plain, want), name


@pytest.mark.parametrize("staged_max_outer", [256, 1])  # staged 2-D slices, or plain tiles
@pytest.mark.parametrize(("src_dtype", "out_dtype"), [
    (np.float32, np.float32), (ml_dtypes.bfloat16, ml_dtypes.bfloat16), (ml_dtypes.bfloat16, np.float32),
    (np.float32, ml_dtypes.bfloat16), (np.int8, np.int8),
])
def test_copy_into_transposes_in_tiles_exactly(monkeypatch, src_dtype, out_dtype, staged_max_outer):
    monkeypatch.setattr("hybridckpt.lazy.element_copy.STRIP_ROWS", 3)
    monkeypatch.setattr("hybridckpt.lazy.element_copy.STAGED_MAX_OUTER", staged_max_outer)
    x = (RNG.standard_normal((2, 11, 7)) * 50).astype(src_dtype)
    for perm in ((0, 2, 1), (2, 1, 0), (1, 0, 2)):
        src = np.ascontiguousarray(x.transpose(perm))  # contiguous along its last axis
        buf = np.empty(src.shape[::-1], out_dtype)
        out = buf.T  # contiguous along its first axis: the copy really transposes
        lazy.copy_into(out, src)
        assert np.array_equal(out.astype(np.float64), src.astype(out_dtype).astype(np.float64)), perm
        if src_dtype == out_dtype:
            assert out.tobytes() == src.tobytes()  # bit for bit (NaN payloads, -0.0 too)
    wide = np.frombuffer(RNG.bytes(2 * 13 * 9), np.uint16).reshape(13, 9).view(ml_dtypes.bfloat16)  # NaNs too
    buf = np.empty((9, 13), ml_dtypes.bfloat16)
    lazy.copy_into(buf.T, wide)
    assert buf.T.view(np.uint16).tolist() == wide.view(np.uint16).tolist()


# -- planning and the fast checksum -----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_tiles_cover_the_box_with_whole_chunks_under_the_budget(data):
    nd = data.draw(st.integers(1, 3))
    chunk = tuple(data.draw(st.integers(1, 4)) for _ in range(nd))
    box = []
    for c in chunk:
        start = data.draw(st.integers(0, 3)) * c
        box.append((start, start + data.draw(st.integers(1, 5)) * c - data.draw(st.integers(0, c - 1))))
    box = tuple(box)
    budget = data.draw(st.integers(4, 400))
    tiles = list(stream.plan_tiles(box, chunk, 4, budget))
    seen = np.zeros(lazy.box_shape(box), dtype=int)
    one_chunk = 4 * int(np.prod(chunk))
    for t in tiles:
        seen[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(t, box, strict=True))] += 1
        for (a, b), (lo, hi), c in zip(t, box, chunk, strict=True):
            assert (a - lo) % c == 0 and ((b - lo) % c == 0 or b == hi)  # whole chunks
        assert 4 * int(np.prod(lazy.box_shape(t))) <= max(budget, one_chunk)
    assert (seen == 1).all()


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_fast_checksum_equals_the_reference(data):
    nd = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.integers(1, 9)) for _ in range(nd))
    box = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        box.append((a, data.draw(st.integers(a + 1, n))))
    box = tuple(box)
    dtype = data.draw(st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.float64]))
    x = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal(lazy.box_shape(box)).astype(dtype)
    block = data.draw(st.sampled_from([1, 5, 64, checksum.BLOCK]))
    old = checksum.BLOCK
    checksum.BLOCK = block
    try:
        assert checksum.box_part(shape, box, x) == checksum_reference.box_part(shape, box, x)
    finally:
        checksum.BLOCK = old


# -- the streaming save is an ordinary Orbax checkpoint ---------------------------------------------


def _tree(mesh):
    """(lazy leaves, the same values as numpy, shardings): a stacked [layers, ...] leaf, a
    leaf replicated on 4 of 8 devices, a bf16 leaf, a 0-d int32."""
    vals = {
        "stacked": RNG.standard_normal((8, 64, 32)).astype(np.float32),
        "repl": RNG.standard_normal((100, 16)).astype(np.float32),
        "half": RNG.standard_normal((48, 40)).astype(ml_dtypes.bfloat16),
        "count": np.asarray(7, dtype=np.int32),
    }
    specs = {"stacked": P("pp", "fsdp", "tp"), "repl": P(None, "tp"), "half": P("fsdp"), "count": P()}
    shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    return vals, shard


def _reference_save(path, arrays, save_args, **options):
    """Orbax's own save of jax.Arrays (replica-parallel off: one writer per shard, as ours);
    `options` go to its PyTreeCheckpointHandler (use_ocdbt, use_compression)."""
    store = ocp.type_handlers.get_type_handler(jax.Array)._array_metadata_store  # noqa: SLF001
    handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=store)
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, handler), (int, ocp.type_handlers.ScalarHandler())
    )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry, **options)) as ck:
        ck.save(path, args=ocp.args.PyTreeSave(arrays, save_args=save_args))


def test_streamed_save_matches_orbax_files_and_restores_on_other_meshes_bitwise(tmp_path):
    mesh_a = fit("fsdp=2,tp=2,pp=2")
    mesh = mesh_from_shape(mesh_a)
    vals, shard = _tree(mesh)
    opts = stream.StreamOptions(tile_bytes=4096, inflight_bytes=16384, chunk_bytes=2048)
    leaves = {
        k: stream.LazyLeaf(lazy.ArrayTensor(v), shard[k], k, (0,) if k == "stacked" else (), opts)
        for k, v in vals.items()
    }
    save_checkpoint(tmp_path / "lazy", 3, leaves, trainer_state={"note": "streamed"})
    assert opts.stats.tiles > len(leaves) and opts.stats.peak_inflight_bytes <= 16384  # tiled, bounded
    from orbax.checkpoint._src.arrays import subchunking  # the chunk shape Orbax's write spec picks

    for k, v in vals.items():  # the CHUNKS checksum on the grid of the chunks written
        leaf = leaves[k]
        want = subchunking.choose_chunk_shape(leaf.shape, tuple(leaf.sharding.shard_shape(leaf.shape)), leaf.dtype,
                                              opts.chunk_bytes, shard_axes=leaf.chunk_axes)
        assert leaf.checksum_chunk == tuple(want), k
        assert leaves[k].checksum == checksum.of_chunks(v, leaves[k].checksum_chunk), k
        assert leaves[k].checksum == checksum_reference.chunks(v, leaves[k].checksum_chunk), k
    # the files Orbax writes for the same jax.Arrays and SaveArgs, raw and without OCDBT (what a
    # raw streaming save is): the same metadata, and every chunk file byte for byte (our own
    # writes, `containers.orbax.chunk_files`, against TensorStore's)
    arrays = {k: jax.device_put(v, shard[k]) for k, v in vals.items()}
    _reference_save(tmp_path / "ref", arrays, stream.save_args(leaves), use_ocdbt=False, use_compression=False)
    ours, ref = tmp_path / "lazy" / "3" / "params", tmp_path / "ref"
    for name in ("_METADATA", "_sharding", "array_metadatas/process_0", *(f"{k}/.zarray" for k in vals)):
        assert json.loads((ours / name).read_text()) == json.loads((ref / name).read_text()), name
    for k in vals:
        names = sorted(os.listdir(ref / k))
        assert sorted(os.listdir(ours / k)) == names and len(names) > (1 if k == "count" else 2), k
        for n in names:
            assert (ours / k / n).read_bytes() == (ref / k / n).read_bytes(), (k, n)
    # restored onto other meshes through CheckpointStore (on 8 devices tp=4,pp=2 and dp=8; on
    # fewer, the meshes of those forms that differ from mesh A; on one, mesh A itself): bit for bit
    others = [m for m in dict.fromkeys(fit_pair(mesh_a, m)[1] for m in ("tp=4,pp=2", "dp=8")) if m != mesh_a]
    for text in others or [mesh_a]:
        other = mesh_from_shape(text)
        specs = {"stacked": P("tp", None, "pp"), "repl": P("pp"), "half": P(None, "tp"), "count": P()}
        if other.shape["dp"] > 1:  # the dp mesh: everything replicated
            specs = {k: P() for k in specs}
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, specs[k]))
                  for k, v in vals.items()}
        with CheckpointStore(tmp_path / "lazy") as store:
            got = store.restore(3, target_params=target).params
        for k, v in vals.items():
            assert got[k].sharding == target[k].sharding
            assert got[k].sharding != shard[k] or k == "count" or text == mesh_a, k
            assert np.array_equal(np.asarray(got[k]), v), k


def _write_hf_llama(path, layers: int, hidden: int = 64, seed: int = 0) -> int:
    cfg = models.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_layers=layers, num_heads=4, num_kv_heads=2)
    rng = np.random.default_rng(seed)
    flat = {k: lazy.ArrayTensor(rng.standard_normal(s.shape).astype(np.float32))
            for k, s in naming.flatten(models.param_shapes(cfg)).items()}
    hf = naming.model_rules(cfg).invert().apply_unstack(flat).tensors
    write_hf(str(path), hf, models.config_to_hf(cfg))
    return sum(t.nbytes for t in hf.values())


def test_import_holds_a_bounded_number_of_tile_bytes_whatever_the_layer_count(tmp_path):
    peaks = []
    for layers in (2, 8):
        src = tmp_path / f"hf{layers}"
        total = _write_hf_llama(src, layers)
        opts = stream.StreamOptions(tile_bytes=8192, inflight_bytes=32768, chunk_bytes=4096)
        jobs.import_checkpoint(str(src), str(tmp_path / f"ck{layers}"), mesh=fit("fsdp=2,tp=2,pp=2"),
                                   stream_options=opts)
        assert opts.stats.bytes_written == total  # every byte written once (no replication here)
        peaks.append((opts.stats.peak_inflight_bytes, opts.stats.largest_tile_bytes))
        assert opts.stats.peak_inflight_bytes <= 32768 < total // 4
    assert peaks[0][1] == peaks[1][1]  # same tiles at 2 and 8 layers: per-layer chunks


_RSS_CHILD = textwrap.dedent("""
    import os, sys, json
    from hybridckpt import jobs  # on this session's devices (XLA_FLAGS, JAX_PLATFORMS inherited)
    from hybridckpt.store import stream
    opts = stream.StreamOptions(tile_bytes=1 << 20, inflight_bytes=4 << 20)
    s = jobs.import_checkpoint(sys.argv[1], sys.argv[2], mesh=sys.argv[3],
                                   params_only=True, stream_options=opts, io_threads=2)
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's RSS)
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
    print(json.dumps({"rss": int(hwm) * 1024, "bytes": s.bytes}))
""")


def test_import_peak_rss_does_not_grow_with_the_checkpoint(tmp_path):
    """Peak RSS of an import in a fresh process, 2 vs 10 layers (~19 vs ~94 MB of fp32): the
    growth stays far below the data's growth (a whole-tree import grows by at least the data)."""
    out = {}
    for layers in (2, 10):
        src = tmp_path / f"hf{layers}"
        _write_hf_llama(src, layers, hidden=512)
        res = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(src), str(tmp_path / f"ck{layers}"),
                              fit("fsdp=2,tp=2,pp=2")],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        out[layers] = json.loads(res.stdout.strip().splitlines()[-1])
    data_growth = out[10]["bytes"] - out[2]["bytes"]
    rss_growth = out[10]["rss"] - out[2]["rss"]
    assert data_growth > 60 * 2**20
    assert rss_growth < 0.3 * data_growth, (rss_growth / 2**20, data_growth / 2**20)


# -- export from Orbax reads lazily -----------------------------------------------------------------


def test_export_of_an_orbax_checkpoint_streams_without_restoring_it(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    jobs.import_checkpoint(sample_path(), ckpt, mesh=fit("fsdp=2,tp=2,pp=2"))
    from hybridckpt.store.manager import CheckpointStore

    def no_restore(*a, **k):
        raise AssertionError("export restored the whole tree")

    monkeypatch.setattr(CheckpointStore, "restore", no_restore)
    out = str(tmp_path / "hf")
    jobs.export_checkpoint(ckpt, out, optimizer=True)
    src_model = read_safetensors(os.path.join(sample_path(), "model.safetensors")).tensors
    got_model = read_safetensors(os.path.join(out, "model.safetensors")).tensors
    src_opt = read_safetensors(os.path.join(sample_path(), "optimizer.safetensors")).tensors
    got_opt = read_safetensors(os.path.join(out, "optimizer.safetensors")).tensors
    assert set(got_model) == set(src_model) and set(got_opt) == set(src_opt)
    for src, got in ((src_model, got_model), (src_opt, got_opt)):
        for k in src:
            assert np.array_equal(got[k].materialize(), src[k].materialize()), k


def test_orbax_array_reads_one_layer_box(tmp_path):
    from hybridckpt.containers.orbax.reader import item_arrays

    mesh = fit_mesh("fsdp=2,tp=2,pp=2")
    vals, shard = _tree(mesh)
    save_checkpoint(tmp_path / "c", 1, {k: jax.device_put(v, shard[k]) for k, v in vals.items()})
    arrays = item_arrays(str(tmp_path / "c" / "1" / "params"))
    assert set(arrays) == set(vals)
    layer = arrays["stacked"].read_box(((5, 6), (0, 64), (8, 24)))
    assert np.array_equal(layer, vals["stacked"][5:6, :, 8:24])
    assert arrays["half"].dtype == vals["half"].dtype and np.array_equal(arrays["half"].materialize(), vals["half"])
    assert arrays["count"].shape == () and int(arrays["count"].materialize()) == 7


# -- parallel reads ---------------------------------------------------------------------------------


def test_prefetcher_gives_the_same_arrays_in_any_order_within_its_window(stored):
    ta, tb, a, b = stored
    tensors = {"a": ta, "b": tb, "c": lazy.transpose(ta), "d": lazy.concat([ta, tb], 1)}
    want = {"a": a, "b": b, "c": a.T, "d": np.concatenate([a, b], 1)}
    pf = parallel.Prefetcher(tensors, ["a", "b", "c", "d"], window_bytes=a.nbytes)
    views = pf.tensors()
    for name in ["d", "a", "c", "b"]:  # not the predicted order
        assert np.array_equal(views[name].materialize(), want[name]), name
        assert pf._held <= max(a.nbytes, tensors["d"].nbytes)  # noqa: SLF001
    assert pf._held == 0 and not pf._futures  # noqa: SLF001


def test_parallel_box_read_equals_serial(stored, monkeypatch):
    ta, tb, a, b = stored
    monkeypatch.setattr(parallel, "MIN_PIECE_BYTES", 16)
    t = lazy.transpose(lazy.concat([ta, tb], 0))
    assert len(parallel.split_box(lazy.full_box(t.shape), 4, 4, 16)) == 4
    assert np.array_equal(parallel.read_box_parallel(t), np.concatenate([a, b]).T)
    got = parallel.read_boxes(t, [((0, 5), (0, 12)), ((5, 10), (2, 9))])
    assert np.array_equal(got[1], np.concatenate([a, b]).T[5:10, 2:9])


def test_io_threads_knob(monkeypatch):
    monkeypatch.delenv(parallel.ENV, raising=False)
    parallel.set_io_threads(None)
    assert parallel.io_threads() == parallel.default_io_threads() >= 2
    monkeypatch.setenv(parallel.ENV, "3")
    assert parallel.io_threads() == 3
    parallel.set_io_threads(5)
    assert parallel.io_threads() == 5
    parallel.set_io_threads(None)
    monkeypatch.setenv(parallel.ENV, "many")
    with pytest.raises(ConfigError, match=parallel.ENV):
        parallel.io_threads()


def test_to_array_places_each_shard_and_sums_its_checksum():
    x = RNG.standard_normal((16, 12)).astype(np.float32)
    mesh = fit_mesh("fsdp=2,tp=2,pp=2")
    for spec in (P("fsdp", "tp"), P(None, "tp"), P()):
        arr, crc = place.to_array(lazy.ArrayTensor(x), NamedSharding(mesh, spec))
        assert arr.sharding == NamedSharding(mesh, spec) and np.array_equal(np.asarray(arr), x)
        assert crc == checksum.of_array(x)


def test_streamed_import_restores_onto_another_mesh(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    jobs.import_checkpoint(sample_path(), ckpt, mesh=fit("fsdp=2,tp=2,pp=2"))
    cfg = jobs.open_checkpoint(sample_path()).config
    shapes = models.param_shapes(cfg)
    mesh = fit_mesh(fit_pair("fsdp=2,tp=2,pp=2", "tp=4,pp=2")[1])
    with CheckpointStore(ckpt) as store:
        r = store.restore(target_params=abstract_tree(shapes, tree_shardings(shapes, models.logical_axes(cfg), mesh)))
    back = naming.tree_to_hf(jax.tree.map(np.asarray, r.params), cfg)
    src = read_safetensors(os.path.join(sample_path(), "model.safetensors")).tensors
    for k, t in src.items():
        assert np.array_equal(back[k].materialize(), t.materialize()), k
