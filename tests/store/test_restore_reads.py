"""A restore onto a mesh that cuts the stored chunks reads each chunk's bytes once (issue 42).

Every chunk of our store is checked against its CRC-32 (`store.checked`), which needs the chunk
whole; a chunk the target mesh cuts between devices is read whole once, checked, cut from that
buffer, and its rest kept for the other devices' boxes, also when those boxes are read at the
same moment by other reader threads (before: each thread that found the rest not yet kept read
the chunk whole again: 1.1x-1.8x the bytes needed on this source). The source is an HF Llama folder
written by safetensors; reads are counted (`count_reads`), not timed, against the bytes of the
chunks the devices' boxes touch (from the chunk grid the import recorded); the values are
compared bit for bit with the source, and every byte read is checked (the account's "checksum"
bytes).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil

import jax
import numpy as np
import pytest
from meshes import fit, fit_pair
from safetensors.numpy import load_file, save_file

import hybridckpt
from hybridckpt import naming
from hybridckpt.errors import CheckpointError
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import tally
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.lazy import parallel
from hybridckpt.store import checked, read_trainer_state

D, FFN, HEADS, KV, LAYERS, VOCAB = 256, 512, 4, 2, 2, 512
SAVED = "fsdp=2,tp=2"
TARGETS = ("fsdp=4", "tp=4")  # rows of every chunk cut in two; columns cut in two
# on 1 device SAVED and every target fit to dp=1: each array is one chunk (per layer), read whole
# into its one shard; what a chunk cut by the target mesh, or a grid of several chunks, does needs 2
CUT = pytest.mark.skipif(jax.device_count() < 2, reason="a chunk cut by the target mesh needs 2 devices")


def shapes() -> dict[str, tuple[int, ...]]:
    hd = D // HEADS
    out = {"model.embed_tokens.weight": (VOCAB, D), "model.norm.weight": (D,), "lm_head.weight": (VOCAB, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (HEADS * hd, D), p + "self_attn.k_proj.weight": (KV * hd, D),
                p + "self_attn.v_proj.weight": (KV * hd, D), p + "self_attn.o_proj.weight": (D, HEADS * hd),
                p + "mlp.gate_proj.weight": (FFN, D), p + "mlp.up_proj.weight": (FFN, D),
                p + "mlp.down_proj.weight": (D, FFN)}
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    src = root / "src"
    src.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
           "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "torch_dtype": "float32", "hidden_act": "silu"}
    (src / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(42)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes().items()},
              str(src / "model.safetensors"))
    ck = str(root / "ck")
    import_checkpoint(str(src), ck, mesh=fit(SAVED))
    return str(src), ck


def needed_bytes(ck: str, params) -> tuple[int, int]:
    """(bytes of the stored chunks the devices' boxes touch, how many of those chunks a box
    cuts), from the chunk grid the import recorded (`trainer_state["checksum_chunks"]`)."""
    grids = read_trainer_state(ck)["checksum_chunks"]
    total = cut = 0
    for key, a in naming.flatten(params).items():
        chunk = grids[f"params.{key}"]
        whole: dict[tuple, bool] = {}  # grid index -> every box touching it holds it whole
        size: dict[tuple, int] = {}  # grid index -> its bytes (edge chunks clipped)
        for index in a.sharding.devices_indices_map(a.shape).values():
            box = [(s.start or 0, a.shape[d] if s.stop is None else s.stop) for d, s in enumerate(index)]
            ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, chunk, strict=True)]
            for pos in np.ndindex(*[len(r) for r in ranges]):
                idx = tuple(r[i] for r, i in zip(ranges, pos, strict=True))
                cbox = [(i * c, min(n, (i + 1) * c)) for i, c, n in zip(idx, chunk, a.shape, strict=True)]
                inside = all(lo <= ca and cb <= hi for (lo, hi), (ca, cb) in zip(box, cbox, strict=True))
                whole[idx] = whole.get(idx, True) and inside
                size[idx] = int(np.prod([cb - ca for ca, cb in cbox])) * a.dtype.itemsize
        total += sum(size.values())
        cut += sum(1 for v in whole.values() if not v)
    return total, cut


def restore_counted(ck: str, mesh: str, **kw):
    with count_reads() as counter:
        cfg, r = hybridckpt.restore(ck, mesh, profile=True, **kw)
    return cfg, r, tally(counter)[0]


def same_as_source(src: str, cfg, params) -> None:
    want = load_file(os.path.join(src, "model.safetensors"))
    back = naming.tree_to_hf(jax.tree.map(np.asarray, params), cfg)
    assert set(back) == set(want)
    for k, v in want.items():
        got = back[k].materialize()
        assert got.dtype == v.dtype and got.tobytes() == v.tobytes(), k


@pytest.fixture
def many_readers():
    parallel.set_io_threads(8)  # (boxes that share chunks read at once, as on a many-core host)
    yield
    parallel.set_io_threads(None)


@pytest.mark.parametrize("target", TARGETS)
def test_a_chunk_cut_by_the_target_mesh_is_read_once(store, target, many_readers):
    src, ck = store
    mesh = fit_pair(fit(SAVED), target)[1]
    for _ in range(3):  # (the threads meet differently from run to run)
        cfg, r, read = restore_counted(ck, mesh)
        needed, cut = needed_bytes(ck, r.params)
        assert cut > 0 or jax.device_count() < 4  # the mesh cuts chunks (on 2 devices it may not)
        assert read <= 1.05 * needed, (mesh, read / needed)
        assert read >= needed  # every chunk touched, read
        assert r.profile.stage("checksum").bytes == needed  # ... and checked, each once
        same_as_source(src, cfg, r.params)


def test_past_the_budget_a_later_piece_is_read_alone(store, many_readers, monkeypatch):
    """With nothing kept (`HELD_BYTES` 0) a later piece of a checked chunk is read from the
    file, that piece only: never the chunk again, and never unchecked."""
    src, ck = store
    monkeypatch.setattr(checked, "HELD_BYTES", 0)
    mesh = fit_pair(fit(SAVED), TARGETS[0])[1]
    cfg, r, read = restore_counted(ck, mesh)
    needed, _ = needed_bytes(ck, r.params)
    assert needed <= read <= 2 * needed
    assert r.profile.stage("checksum").bytes == needed
    same_as_source(src, cfg, r.params)


def test_a_damaged_chunk_the_target_cuts_is_still_caught(store, tmp_path, many_readers):
    _, ck = store
    bad = str(tmp_path / "ck")
    shutil.copytree(ck, bad)
    step = next(d for d in os.listdir(bad) if d.isdigit())
    chunk = os.path.join(bad, step, "params", "layers.up.kernel", "0.0.0")  # (a raw import: a file per chunk)
    with open(chunk, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=r"layers\.up\.kernel: chunk 0\.0\.0 .*CRC-32"):
        hybridckpt.restore(bad, fit_pair(fit(SAVED), TARGETS[0])[1])


def test_the_rest_kept_for_another_process_is_given_back(store):
    """A process whose devices need one piece of a cut chunk (the rest is another host's) keeps
    the rest within the shared budget while its boxes are read, and gives it back after
    (`CheckedArray.release`, called by `read_items` once an array is placed)."""
    src, ck = store
    step = next(d for d in os.listdir(ck) if d.isdigit())
    folder = os.path.join(ck, step, "params")
    from hybridckpt.containers.orbax.reader import item_arrays

    state = read_trainer_state(ck)
    arrays = checked.checked_arrays({"params.layers.up.kernel": item_arrays(folder)["layers.up.kernel"]},
                                    state, "", folder)
    t = arrays["params.layers.up.kernel"]
    chunk = t.chunk
    assert chunk[1] > 1  # (rows of a chunk to cut)
    box = tuple((0, c) for c in chunk[:1]) + ((0, chunk[1] // 2),) + tuple((0, c) for c in chunk[2:])
    before = checked._HeldChunks.used()  # noqa: SLF001
    out = np.empty([b - a for a, b in box], dtype=t.dtype)
    with count_reads() as counter:
        t.read_into(box, out)
    assert tally(counter)[0] == int(np.prod(chunk)) * t.dtype.itemsize  # the chunk whole, to check it
    assert checked._HeldChunks.used() - before == 2 * out.nbytes  # noqa: SLF001  (kept for its other half)
    t.release()
    assert checked._HeldChunks.used() == before  # noqa: SLF001
    up0 = load_file(os.path.join(src, "model.safetensors"))["model.layers.0.mlp.up_proj.weight"].T  # (a kernel)
    assert out[0].tobytes() == np.ascontiguousarray(up0[box[1][0]:box[1][1], box[2][0]:box[2][1]]).tobytes()


def _up_kernel(ck: str) -> checked.CheckedArray:
    from hybridckpt.containers.orbax.reader import item_arrays

    step = next(d for d in os.listdir(ck) if d.isdigit())
    folder = os.path.join(ck, step, "params")
    return checked.checked_arrays({"params.layers.up.kernel": item_arrays(folder)["layers.up.kernel"]},
                                  read_trainer_state(ck), "", folder)["params.layers.up.kernel"]


def _halves(t: checked.CheckedArray) -> list[tuple]:
    """The two halves (rows) of the array's first chunk."""
    c = t.chunk
    return [((0, 1), (a, b), (0, c[2])) for a, b in ((0, c[1] // 2), (c[1] // 2, c[1]))]


def _dry(t: checked.CheckedArray, boxes) -> int:
    from hybridckpt.io.byte_source import planning

    with count_reads(this_thread=True) as plan, planning(), np.errstate(all="ignore"):
        for box in boxes:
            t.read_into(box, np.zeros([b - a for a, b in box], dtype=t.dtype))
    return tally(plan)[0]


def test_a_dry_read_leaves_nothing_a_real_read_would_take(store):
    """A read plan (`io.byte_source.planning`: an import sizing its tiles reads the first one dry,
    `store.stream.leaf_tiling`) of a box that cuts a chunk is counted as the real read would
    be, and leaves no state behind: before, it kept its unread buffer as the chunk's rest and
    marked the chunk checked, so a real read that followed took the plan's garbage for its
    values, or read the chunk unchecked."""
    src, ck = store
    t = _up_kernel(ck)
    halves = _halves(t)
    chunk_bytes = int(np.prod(t.chunk)) * t.dtype.itemsize
    assert _dry(t, halves[:1]) == chunk_bytes  # the chunk whole, as the real read below
    up0 = load_file(os.path.join(src, "model.safetensors"))["model.layers.0.mlp.up_proj.weight"].T
    with count_reads() as real:
        for box in halves:
            out = np.empty([b - a for a, b in box], dtype=t.dtype)
            t.read_into(box, out)
            assert out[0].tobytes() == np.ascontiguousarray(up0[box[1][0]:box[1][1], : t.chunk[2]]).tobytes()
    assert tally(real)[0] == chunk_bytes


def test_a_dry_read_does_not_mark_a_chunk_checked(store, tmp_path):
    _, ck = store
    bad = str(tmp_path / "ck")
    shutil.copytree(ck, bad)
    step = next(d for d in os.listdir(bad) if d.isdigit())
    with open(os.path.join(bad, step, "params", "layers.up.kernel", "0.0.0"), "r+b") as f:
        f.seek(8)
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 0x01]))
    t = _up_kernel(bad)
    halves = _halves(t)
    _dry(t, halves)
    with pytest.raises(CheckpointError, match=r"chunk 0\.0\.0 .*CRC-32"):
        for box in halves:
            t.read_into(box, np.empty([b - a for a, b in box], dtype=t.dtype))


# -- pieces read straight into the shards (`CheckedArray.direct`, on in a restore) ------------------

FIRST_AXIS_CUT = ("layers.up.kernel", "layers.gate.kernel", "layers.q.kernel")  # fsdp=4 cuts their rows
COLUMN_CUT = ("layers.o.kernel", "layers.down.kernel", "embed.embedding")  # fsdp=4 cuts their columns


@pytest.fixture
def counted_copies(monkeypatch):
    """Per array name, what a restore did: box by box (`store.checked`), `buffers`, every
    `inner.read_box` of a CheckedArray (a chunk read whole into a fresh buffer), `copies`, every
    `copy_into` (a piece copied into its shard), `crcs`, every CRC-32 call over a buffer (`_crc`),
    `row_crcs`, every CRC-32 call continued row by row (`checksum.crc32_update`); by chunks
    (`store.chunk_fill`), `jobs`, every chunk read, `chunk_crcs`, every CRC-32 call of a job,
    `parts`, every part copied out of a lent buffer, `into_place`, every chunk read straight into
    its shard; and `lent`, the buffers the restore's scratch pool made (`io.aligned_pool`), all
    names together."""
    import threading
    from collections import Counter

    from hybridckpt import checksum
    from hybridckpt.containers.orbax import reader
    from hybridckpt.io import aligned_pool
    from hybridckpt.store import chunk_fill

    kinds = ("buffers", "copies", "crcs", "row_crcs", "lent", "jobs", "chunk_crcs", "parts", "into_place")
    counts = {k: Counter() for k in kinds}
    where = threading.local()
    piece, read_box, copy, crc = checked.CheckedArray._piece, reader.OrbaxArray.read_box, checked.copy_into, checked._crc
    update, made, run, crc_of = checksum.crc32_update, aligned_pool.aligned_empty, chunk_fill.ChunkJob.run, checksum.crc32_of

    def _piece(self, *a, **k):
        where.name = self.name
        try:
            return piece(self, *a, **k)
        finally:
            where.name = None

    def _run(self, lent):
        name = self.fill.array.name
        counts["jobs"][name] += 1
        if self.into_place is None:
            counts["parts"][name] += len(self.parts)
        else:
            counts["into_place"][name] += 1
        where.job = name
        try:
            return run(self, lent)
        finally:
            where.job = None

    def _crc_of(data):
        job = getattr(where, "job", None)
        if job is not None:
            counts["chunk_crcs"][job] += 1
        return crc_of(data)

    def counted(kind, fn):
        def call(*a, **k):
            counts[kind][getattr(where, "name", None)] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(checked.CheckedArray, "_piece", _piece)
    monkeypatch.setattr(reader.OrbaxArray, "read_box", lambda self, box: (counts["buffers"].update([self.name]),
                                                                          read_box(self, box))[1])
    monkeypatch.setattr(checked, "copy_into", counted("copies", copy))
    monkeypatch.setattr(checked, "_crc", counted("crcs", crc))
    monkeypatch.setattr(checksum, "crc32_update", counted("row_crcs", update))
    monkeypatch.setattr(checksum, "crc32_of", _crc_of)
    monkeypatch.setattr(aligned_pool, "aligned_empty", counted("lent", made))
    monkeypatch.setattr(chunk_fill.ChunkJob, "run", _run)
    return counts


def chunk_parts(a, chunk) -> tuple[int, int, int]:
    """(chunks the devices' boxes meet, parts: the (chunk, distinct box) pairs that meet, chunks
    read straight into place: met by one box that holds it whole as one run of its bytes) of array
    `a` on its sharding, its stored grid `chunk`."""
    boxes = {tuple((s.start or 0, a.shape[d] if s.stop is None else s.stop) for d, s in enumerate(index))
             for index in a.sharding.devices_indices_map(a.shape).values()}
    met: dict[tuple, list] = {}
    for box in boxes:
        ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, chunk, strict=True)]
        for idx in itertools.product(*ranges):
            met.setdefault(idx, []).append(box)
    into_place = 0
    for idx, held_by in met.items():
        cbox = [(i * c, min(n, (i + 1) * c)) for i, c, n in zip(idx, chunk, a.shape, strict=True)]
        box = held_by[0]
        whole = all(lo <= ca and cb <= hi for (ca, cb), (lo, hi) in zip(cbox, box, strict=True))
        ext = [cb - ca for ca, cb in cbox]
        first = next((d for d, e in enumerate(ext) if e > 1), len(ext))
        one_run = all(ext[d] == box[d][1] - box[d][0] for d in range(first + 1, len(ext)))
        into_place += len(held_by) == 1 and whole and one_run
    return len(met), sum(len(v) for v in met.values()), into_place


@CUT
def test_a_chunk_the_target_cuts_is_read_once_and_copied_into_each_shard(store, many_readers, counted_copies):
    """fsdp=2,tp=2 -> fsdp=4 cuts every kernel chunk in two: on its rows (q/gate/up) or across them
    (o/down/embed: strips of each row). Each chunk is read whole once (`store.chunk_fill`), by one
    pread into the buffer its worker borrowed from the restore's scratch pool, checked by one
    CRC-32 call, and each part copied into its shard. Box by box (before), a chunk cut on its rows
    was two reads into two lent buffers and two CRC-32 calls joined by `crc32_combine`, and one cut
    across them was read whole by one box, its rest kept for the other. No fresh chunk buffer, no
    box-by-box read, at most one buffer the pool made a worker, every byte read once and checked,
    the values the source's."""
    src, ck = store
    counts = counted_copies
    cfg, r, read = restore_counted(ck, fit_pair(fit(SAVED), TARGETS[0])[1])
    needed, cut = needed_bytes(ck, r.params)
    assert cut > 0
    grids = read_trainer_state(ck)["checksum_chunks"]
    for name in FIRST_AXIS_CUT + COLUMN_CUT:
        a = naming.flatten(r.params)[name]
        chunks, parts, into_place = chunk_parts(a, grids[f"params.{name}"])
        assert parts > chunks and into_place == 0, (name, chunks, parts)  # (each chunk cut)
        assert counts["jobs"][name] == counts["chunk_crcs"][name] == chunks, (name, counts)
        assert counts["parts"][name] == parts and counts["into_place"][name] == 0, (name, counts)
        assert counts["buffers"][name] == counts["copies"][name] == counts["row_crcs"][name] == 0, (name, counts)
    assert 0 < sum(counts["lent"].values()) <= parallel.io_threads(), counts["lent"]
    assert read == needed
    assert r.profile.stage("checksum").bytes == needed
    same_as_source(src, cfg, r.params)


@pytest.mark.parametrize("target", [SAVED, *TARGETS])
def test_every_chunk_is_read_once_straight_into_its_shard_where_it_can_be(store, target, counted_copies):
    """A chunk one box holds whole as one run of its bytes (restored onto the mesh the store was
    written on, every chunk that is its shard) is read straight into its shard and checked there:
    no lent buffer, no copy. Each other chunk is read into a lent buffer and each of its parts
    copied out. Counted against the chunk grid the import recorded: every chunk met read once,
    every part placed once, at most one buffer the scratch pool made a worker."""
    src, ck = store
    counts = counted_copies
    cfg, r, read = restore_counted(ck, fit_pair(fit(SAVED), target)[1])
    grids = read_trainer_state(ck)["checksum_chunks"]
    total_place = 0
    for name, a in naming.flatten(r.params).items():
        chunks, parts, into_place = chunk_parts(a, grids[f"params.{name}"])
        if counts["jobs"][name] == 0:  # (box by box: an array that is one chunk, or a padded edge)
            continue
        assert counts["jobs"][name] == chunks and counts["into_place"][name] == into_place, (name, counts)
        assert counts["parts"][name] == parts - into_place, (name, counts)
        total_place += into_place
    if target == SAVED:  # (q/k/v/gate/up: each chunk its box; o/down/embed: chunks narrower than it)
        assert total_place > 0, counts
    assert sum(counts["lent"].values()) <= parallel.io_threads(), counts["lent"]
    needed, _ = needed_bytes(ck, r.params)
    assert read == needed and r.profile.stage("checksum").bytes == needed
    same_as_source(src, cfg, r.params)


def _damaged(ck: str, tmp_path, at: int) -> str:
    bad = str(tmp_path / "ck")
    shutil.copytree(ck, bad)
    step = next(d for d in os.listdir(bad) if d.isdigit())
    with open(os.path.join(bad, step, "params", "layers.up.kernel", "0.0.0"), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    return bad


@pytest.mark.parametrize("half", [0, 1])
def test_a_damaged_byte_in_either_piece_read_into_a_shard_is_caught(store, tmp_path, many_readers, half):
    _, ck = store
    chunk = _up_kernel(ck).chunk
    at = (half * chunk[1] // 2 + 3) * chunk[2] * 4 + 12  # (a byte of row 3 of that half)
    with pytest.raises(CheckpointError, match=r"layers\.up\.kernel: chunk 0\.0\.0 .*CRC-32"):
        hybridckpt.restore(_damaged(ck, tmp_path, at), fit_pair(fit(SAVED), TARGETS[0])[1])


@pytest.mark.parametrize("damaged", [False, True])
def test_a_chunk_only_one_piece_of_which_was_read_is_checked_at_release(store, tmp_path, damaged):
    """A process whose devices need one half of a chunk (the other half is another host's) reads
    that half alone into its shard; `release` then reads the chunk whole and checks it: a byte
    damaged in the half never placed is still caught."""
    _, ck = store
    chunk = _up_kernel(ck).chunk
    ck = _damaged(ck, tmp_path, (chunk[1] // 2 + 1) * chunk[2] * 4) if damaged else ck
    t = _up_kernel(ck)
    t.direct = True
    box = _halves(t)[0]
    out = np.empty([b - a for a, b in box], dtype=t.dtype)
    with count_reads() as first:
        t.read_into(box, out)
    assert tally(first)[0] == out.nbytes  # (the half alone, no chunk buffer)
    if damaged:
        with pytest.raises(CheckpointError, match=r"chunk 0\.0\.0 .*CRC-32"):
            t.release()
        return
    with count_reads() as rest:
        t.release()
    assert tally(rest)[0] == 2 * out.nbytes and not t._landed  # noqa: SLF001


def test_pieces_crcs_combine_to_the_whole_in_any_order():
    from hybridckpt import checksum

    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    cuts = [0, 1, 977, 4096, 9999, 10_000]
    pieces = {a: (b - a, checksum.crc32_of(data[a:b])) for a, b in zip(cuts, cuts[1:], strict=False)}
    assert checksum.crc32_of_pieces(dict(reversed(list(pieces.items()))), data.size) == checksum.crc32_of(data)
    assert checksum.crc32_of_pieces({k: v for k, v in pieces.items() if k}, data.size) is None  # (not all there)


@CUT
def test_a_box_of_the_raw_chunk_grid_visits_only_the_chunks_it_meets(store, monkeypatch):
    """The raw array's chunks are a regular grid (`containers.orbax.reader.ChunkGrid`): a box finds
    the chunks it meets by their grid index. Before, `lazy.Tiled` tested every chunk of the array
    for each box (72 tests for one piece of a 72-chunk array: 63k in the 1.1 GB restore of
    docs/benchmarks.md). Counted: the overlap tests of each read equal the chunks met, and the
    bytes are those of the same blocks read by a `Tiled` over every block."""
    from hybridckpt.containers.orbax import reader
    from hybridckpt.lazy import Tiled

    _, ck = store
    grid = _up_kernel(ck).inner.raw()
    # (9+ chunks where the saved mesh is fsdp=2,tp=2; on 2 devices, tp=2, 2 x 2: a box of one still tests 1 of 4)
    assert isinstance(grid, reader.ChunkGrid) and len(grid.pieces) > (4 if jax.device_count() >= 4 else 3)
    tests = []
    real = reader.block_overlap
    monkeypatch.setattr(reader, "block_overlap", lambda *a: (tests.append(1), real(*a))[1])
    c, n = grid.chunk, grid.shape
    boxes = [((0, 1), (0, c[1] // 2), (0, c[2])),  # half of one chunk
             ((1, 2), (c[1] // 2, n[1]), (c[2] - 3, c[2] + 5)),  # across two chunks' edges, to the end
             tuple((0, m) for m in n)]  # all of it
    everything = Tiled(grid.shape, grid.dtype, grid.pieces)
    for box in boxes:
        met = int(np.prod([-(-b // k) - a // k for (a, b), k in zip(box, c, strict=True)]))
        tests.clear()
        got = np.empty([b - a for a, b in box], dtype=grid.dtype)
        grid.read_into(box, got)
        assert len(tests) == met, (box, len(tests))
        assert got.tobytes() == everything.read_box(box).tobytes()


def test_the_next_array_is_read_while_a_chunk_of_the_one_before_is_still_read(store, monkeypatch):
    """The workers take the chunks of every array from one queue in order (`store.chunk_fill`): a
    worker past its array's last chunk takes the next array's instead of waiting at its end for
    the slowest chunk. Counted, not timed: the first chunk read is held back until a chunk of
    another array begins (box by box, before `PLACED_AT_ONCE`: none began until the first array
    was placed, so the hold ran out its guard); values the source's, every byte read once."""
    import threading

    from hybridckpt.store import chunk_fill

    src, ck = store
    monkeypatch.setattr(parallel, "_override", 4)  # (put back after the test)
    began, lock, held = threading.Event(), threading.Lock(), []
    real = chunk_fill.ChunkJob.run

    def run(self, lent):
        name = self.fill.array.name
        with lock:
            first = not held
            if first:
                held.append(name)
        if first:
            held.append(began.wait(20))  # (a guard against a hang)
        elif name != held[0]:
            began.set()
        return real(self, lent)

    monkeypatch.setattr(chunk_fill.ChunkJob, "run", run)
    cfg, r, read = restore_counted(ck, fit_pair(fit(SAVED), TARGETS[0])[1])
    assert held[1] is True, held  # (another array's chunk began while the first was held)
    needed, _ = needed_bytes(ck, r.params)
    assert read == needed
    same_as_source(src, cfg, r.params)
