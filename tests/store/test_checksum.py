"""Per-tensor checksums: independent of sharding (ELEMENTS) or on a recorded chunk grid (CHUNKS,
what an import records), recorded at import, re-checked by `verify CKPT`."""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_count, fit, fit_mesh
from oracles import checksum_reference

from hybridckpt import checksum, jobs
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.errors import CheckpointError
from hybridckpt.jobs.restore import restore
from hybridckpt.store import CheckpointStore, read_trainer_state


def test_checksum_is_sharding_independent_and_sensitive():
    x = np.random.default_rng(0).standard_normal((8, 6, 4)).astype(np.float32)
    want = checksum.of_array(x)
    mesh = fit_mesh("fsdp=2,tp=2,pp=2")
    for spec in (P("pp", "fsdp", "tp"), P(None, "tp"), P()):
        assert checksum.of_array(jax.device_put(x, NamedSharding(mesh, spec))) == want
    flipped = x.copy()
    flipped.view(np.uint32)[3, 2, 1] ^= 1  # one bit
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksum.of_array(flipped) != want
    assert checksum.of_array(swapped) != want
    box = ((2, 5), (1, 6), (0, 4))
    parts = checksum.box_part(x.shape, box, x[2:5, 1:6, :])
    rest = checksum.of_array(x) - parts
    assert parts != 0 and rest != 0


CHUNK_CASES = [
    ((8, 6, 4), (1, 6, 4), np.float32),  # per-layer chunks of a stacked leaf
    ((10, 7), (4, 3), ml_dtypes.bfloat16),  # edge boxes clipped on both axes
    ((5, 9), (5, 9), np.int32),  # one chunk
    ((), (), np.int32),  # a 0-d step counter
    ((6, 4), (2, 4), np.float16),
]


@pytest.mark.parametrize(("shape", "chunk", "dtype"), CHUNK_CASES)
def test_chunks_checksum_matches_the_oracle_over_any_tiling_and_catches_damage(shape, chunk, dtype):
    rng = np.random.default_rng(len(shape) + sum(chunk))
    x = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    want = checksum.of_chunks(x, chunk)
    assert want == checksum_reference.chunks(x, chunk)
    # tiles of 1 or 2 grid boxes along dim 0 (an import's tiles are whole chunks) sum to the same
    if shape:
        for per in (1, 2):
            step = per * chunk[0]
            tiles = [((a, min(shape[0], a + step)), *((0, n) for n in shape[1:])) for a in range(0, shape[0], step)]
            parts = [checksum.tile_part(shape, chunk, t, x[tuple(slice(a, b) for a, b in t)]) for t in tiles]
            assert checksum.combine(parts) == want
    flipped = x.copy()
    flipped.reshape(-1).view(f"u{x.dtype.itemsize}")[x.size // 2] ^= 1  # one bit
    assert checksum.of_chunks(flipped, chunk) != want
    if x.size > 1:
        flat = x.reshape(-1).copy()
        i = int(np.flatnonzero(flat != flat[0])[0])  # two different elements swapped
        flat[[0, i]] = flat[[i, 0]]
        assert checksum.of_chunks(flat.reshape(shape), chunk) != want
    if shape and shape[0] >= 2 * chunk[0]:  # two whole chunks swapped: the crc of each is the same
        swapped = x.copy()
        c = chunk[0]
        swapped[:c], swapped[c : 2 * c] = x[c : 2 * c], x[:c]
        assert checksum.of_chunks(swapped, chunk) != want


def test_the_fast_crc32_is_zlibs_crc32():
    """The CRC-32 the CHUNKS checksum uses (zlib-ng's, where installed) gives binascii's values on
    every length and alignment, so imports recorded with either verify with either."""
    import binascii

    from hybridckpt.checksum import _crc32

    raw = np.random.default_rng(5).integers(0, 256, 70_001, dtype=np.uint8)
    for a, b in ((0, 0), (0, 1), (3, 70_001), (1, 4097), (17, 65_553), (64, 64 + 8 * 1024)):
        piece = memoryview(raw)[a:b]
        assert _crc32(piece) == binascii.crc32(bytes(piece)), (a, b)


def test_chunks_checksum_refuses_a_grid_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        checksum.of_chunks(np.zeros((4, 4), np.float32), (2,))
    with pytest.raises(ValueError, match="does not start on the grid"):
        checksum.chunk_part((4, 4), (2, 2), ((1, 3), (0, 2)), np.zeros((2, 2), np.float32))


@pytest.fixture()
def imported(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    jobs.import_checkpoint(sample_path(), ckpt, mesh=fit("fsdp=2,tp=2,pp=2"))
    return ckpt


def test_verify_recorded_checksums_then_detect_a_changed_tensor(imported, capsys):
    sums = read_trainer_state(imported)["checksums"]
    assert "params.layers.q.kernel" in sums and "mu.layers.q.kernel" in sums
    assert main(["verify", imported]) == 0
    # rewrite the step with one element changed but the recorded checksums kept
    _, r = restore(imported, "dp=1")
    state, opt_state = r.trainer_state, r.opt_state
    params = jax.tree.map(np.array, r.params)
    params["layers"]["down"]["kernel"][1, 3, 5] += 1e-6
    bad = imported + "-bad"
    with CheckpointStore(bad) as store:
        store.save(state["step"], params, opt_state, {k: v for k, v in state.items() if k not in ("step", "mesh")})
    # a save of new arrays records its own checksums, not the old ones (issue 37: a training
    # loop's saves are checked too): put the old ones back, as damage would
    from pathlib import Path

    from hybridckpt.store.save import _add_to_trainer_state

    assert read_trainer_state(bad)["checksums"] != state["checksums"]
    assert main(["verify", bad]) == 0
    kept = {k: state[k] for k in ("checksums", "checksum_chunks", "checksum_algorithm", "chunk_crc32")}
    _add_to_trainer_state(Path(bad) / str(state["step"]), kept)
    capsys.readouterr()
    assert main(["verify", bad]) == 1
    out = capsys.readouterr().out
    assert "BAD params.layers.down.kernel" in out and "36/37 arrays match" in out  # (the step counter too)
    with pytest.raises(CheckpointError, match=r"layers.down.kernel: chunk .* has CRC-32"):
        restore(bad, "dp=1")  # every read checked, not only verify's


def _chunk_locations(item_dir: str, array: str) -> list[list[tuple[str, int, int]]]:
    """Per stored chunk of `array` in an Orbax item, every (data file, offset, length) where its
    bytes lie. A raw import's item has a file per chunk. OCDBT only appends: a small chunk is kept inline in b-tree nodes, and the nodes of
    earlier commits stay in the files unreferenced, so one chunk's bytes can lie in several
    places of which one is live; flipping a byte in all of them surely flips live array data
    (flipping one place at random, as this test once did, sometimes hit a dead copy)."""
    import tensorstore as ts

    folder = os.path.join(item_dir, array)
    if not os.path.exists(os.path.join(item_dir, "manifest.ocdbt")):  # a raw import: a file a chunk
        names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
        return [[(os.path.join(folder, n), 0, os.path.getsize(os.path.join(folder, n)))] for n in names]
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(item_dir)}/"}).result()
    values = [kv.read(k).result().value for k in kv.list().result() if k.startswith(f"{array}/".encode())]
    values = [v for v in values if not v.startswith(b"{")]  # chunks, not the .zarray metadata
    files = [os.path.join(r, f) for r, _, fs in os.walk(item_dir) for f in fs if "/d/" in os.path.join(r, f)]
    out = []
    for v in values:
        places = []
        for path in files:
            data = open(path, "rb").read()
            at = data.find(v)
            while at >= 0:
                places.append((path, at, len(v)))
                at = data.find(v, at + 1)
        out.append(places)
    return out


@pytest.fixture()
def imported_zstd(tmp_path):
    """Imported with Orbax's zstd on fsdp=2,tp=2,pp=2: a small chunk's compressed bytes (barely
    compressible) stay verbatim inside the zstd-compressed B-tree node that inlines them, so
    `_chunk_locations` finds them (a raw import, the default codec, keeps every chunk in a file of
    its own). That holds for the nodes of this layout (on one device, with 1 chunk per norm and
    bigger nodes, zstd Huffman-codes the literals and no chunk is found verbatim), so with fewer
    than 8 devices the CLI writes it in a child process on 8 simulated CPU devices."""
    ckpt = str(tmp_path / "ckpt")
    if device_count() >= 8:
        jobs.import_checkpoint(sample_path(), ckpt, mesh="fsdp=2,tp=2,pp=2", compression="zstd")
        return ckpt
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-m", "hybridckpt.cli", "import", sample_path(), ckpt, "--mesh",
                    "fsdp=2,tp=2,pp=2", "--compression", "zstd", "--quiet"], env=env, check=True)
    return ckpt


@pytest.mark.parametrize(
    ("array", "codec"),
    # raw chunks are files of their own (final_norm.scale too); a zstd import's small chunks are
    # inline in OCDBT B-tree nodes
    [("layers.down.kernel", "none"), ("embed.embedding", "none"), ("final_norm.scale", "none"),
     ("layers.down.kernel", "zstd"), ("embed.embedding", "zstd"), ("final_norm.scale", "zstd")],
)
def test_a_flipped_byte_inside_array_data_is_always_reported(request, capsys, array, codec):
    """One byte flipped in the middle of a stored chunk of `array` (located through the OCDBT
    index, so it surely lies inside array data): `verify CKPT` reads what is on disk and reports
    that array, by checksum (exit 1) or as undecodable (one line, exit 2), never 'all match'."""
    imported = request.getfixturevalue("imported" if codec == "none" else "imported_zstd")
    params = os.path.join(imported, "12", "params")
    chunks = _chunk_locations(params, array)
    assert chunks and all(chunks), array
    places = chunks[len(chunks) // 2]
    assert places, array
    for path, at, length in places:
        with open(path, "r+b") as f:
            f.seek(at + length // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    capsys.readouterr()
    code = main(["verify", imported])
    out = capsys.readouterr()
    assert code == 1, (code, out)
    # a flipped chunk fails its checksum or its decoding; a flipped inline copy in a b-tree node
    # makes every array of that node unreadable: either way the array is named, on one line each
    assert f"BAD params.{array}: " in out.out, out.out
    assert all(len(line) < 600 for line in out.out.splitlines())


def test_import_records_chunks_checksums_on_the_stored_grid(imported):
    state = read_trainer_state(imported)
    assert state["checksum_algorithm"] == checksum.CHUNKS
    grids, sums = state["checksum_chunks"], state["checksums"]
    assert set(grids) == set(sums)
    _, r = restore(imported, "dp=1")
    q = np.asarray(r.params["layers"]["q"]["kernel"])
    grid = tuple(grids["params.layers.q.kernel"])
    assert grid[0] == 1 and grid != q.shape  # per layer, and more than one chunk
    assert checksum.to_hex(checksum.of_chunks(q, grid)) == sums["params.layers.q.kernel"]
    assert checksum.to_hex(checksum.of_array(q)) != sums["params.layers.q.kernel"]  # not ELEMENTS


def test_verify_reads_an_older_elements_checksum_import(tmp_path, capsys):
    """An import from before CHUNKS recorded ELEMENTS sums and no algorithm: still verified by
    them, and a changed value still caught."""
    imported = str(tmp_path / "ckpt")
    jobs.import_checkpoint(sample_path(), imported, mesh=fit("fsdp=2,tp=2,pp=2"), params_only=True)
    _, r = restore(imported, "dp=1")
    state = dict(r.trainer_state)
    flat = {f"params.{k}": v for k, v in _flat(r.params).items()}
    old = {k: checksum.to_hex(checksum.of_array(np.asarray(v))) for k, v in flat.items()}
    assert set(old) == set(state["checksums"])
    path = os.path.join(imported, str(state["step"]), "trainer_state", "metadata")
    saved = json.loads(open(path).read())
    for k in ("checksum_algorithm", "checksum_chunks"):
        saved.pop(k)
    saved["checksums"] = old
    open(path, "w").write(json.dumps(saved))
    capsys.readouterr()
    assert main(["verify", imported]) == 0
    saved["checksums"]["params.final_norm.scale"] = checksum.to_hex(1)
    open(path, "w").write(json.dumps(saved))
    assert main(["verify", imported]) == 1
    assert "BAD params.final_norm.scale" in capsys.readouterr().out


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out
