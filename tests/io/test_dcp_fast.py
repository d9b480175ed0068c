"""The two readers of DCP `.metadata` agree: the specialised one (`containers.dcp_fast`, columns,
no object per chunk) and the restricted unpickler (`containers.dcp_stubs.extract`).

On every real `.metadata` of the corpus (torchtitan, megatron-core torch_dist: written by the
tools), on files torch's own planner writes here (many ranks, names holding the MEMOIZE byte,
names past 255 bytes, 0-d and empty tensors, byte items), and on hostile bytes (every
truncation, byte flips, huge counts): the same tables or the same one-line error, and the
specialised reader really reads the real files (it does not fall back).
"""

from __future__ import annotations

import glob
import os
import pickle
import shutil

import numpy as np
import pytest

from hybridckpt.containers import dcp_fast
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.containers.dcp_stubs import DCP_POLICY, extract
from hybridckpt.containers.dcp_tables import RawTables, assemble
from hybridckpt.containers.pickle.machine import safe_load_file
from hybridckpt.errors import HybridCkptError

REAL = os.path.join(os.path.dirname(__file__), "..", "real", "cases")
REAL_FILES = sorted(glob.glob(os.path.join(REAL, "*", "ckpt", "**", ".metadata"), recursive=True))


def _canonical(got, rest) -> dict:
    """What a reader found, independent of row order: per tensor its dtype, shape and chunks
    (offsets, sizes, file, start, length) in order; byte items; planner data; version."""
    t = got.table
    tensors = {}
    for fqn, dt, shape, first, count in got.tensors:
        nd = len(shape)
        rows = range(first, first + count)
        tensors[fqn] = (
            str(dt),
            tuple(shape),
            [
                (tuple(t.offsets[r, :nd].tolist()), tuple(t.sizes[r, :nd].tolist()), t.files[t.file[r]],
                 int(t.start[r]), int(t.length[r]))
                for r in rows
            ],
        )
    byte_fqns, planner, version, written = rest
    return {"tensors": tensors, "items": dict(got.items), "bytes": sorted(byte_fqns),
            "planner": repr(planner), "version": version, "written": written}  # repr: stubs have no ==


def _fast(path: str):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    raw, rest = dcp_fast.read(data, path)
    return _canonical(assemble(raw, os.path.dirname(path), path), rest)


def _general(path: str):
    raw = RawTables()
    rest = extract(safe_load_file(path, DCP_POLICY), raw, path)
    return _canonical(assemble(raw, os.path.dirname(path), path), rest)


def test_the_corpus_has_real_metadata_of_both_tools():
    names = {os.path.relpath(p, REAL).split(os.sep)[0] for p in REAL_FILES}
    assert any(n.startswith("torchtitan") for n in names)
    assert any(n.startswith("megatron_core") for n in names)


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: os.path.relpath(p, REAL).split(os.sep)[0])
def test_real_metadata_both_readers_agree(path):
    fast, general = _fast(path), _general(path)  # _fast raises Fallback if it gave up
    assert fast == general
    assert fast["tensors"] and sum(len(c) for _, _, c in fast["tensors"].values()) > len(fast["tensors"])
    assert read_metadata(os.path.dirname(path)).readers == ("fast",)


def test_megatron_plans_refetch_chunks():
    """megatron-core's `.metadata` holds every rank's save plan (`all_local_plans`), whose write
    items fetch the chunk objects again from the memo: the specialised reader rebuilds them."""
    path = next(p for p in REAL_FILES if "megatron_core" in p)
    md = safe_load_file(path, DCP_POLICY)
    plans = vars(md)["all_local_plans"]
    assert plans and vars(plans[0])["items"]
    with open(path, "rb") as f:
        data = bytearray(f.read())
    frames = dcp_fast.deframe(data)
    m = dcp_fast._Machine(bytes(data), frames, path, RawTables())
    m.run()
    assert len(m.chunk_idx) > 0 and m.converted  # chunks matched, then fetched again


# -- files torch writes here ------------------------------------------------------------------


def _torch_written(folder: str) -> str:
    """A DCP save of 4 ranks by torch's planner: sharded tensors (several chunks each, 1-d, 2-d,
    3-d), a 0-d tensor, an empty tensor, byte items, a name holding the MEMOIZE byte (0x94, in
    U+2014) and one past 255 bytes; more than 256 memo entries (LONG_BINGET)."""
    import torch
    from fixtures.dcp_ranks import Shards, save_ranks

    ranks = 4
    shapes = {
        "model.w": (8, 6),
        "model.norm\u2014w": (12,),  # UTF-8 e2 80 94: a MEMOIZE byte inside the string
        "model." + "x" * 300: (4, 3, 2),
        "model.uneven": (10, 4),
    }
    per_rank = []
    for r in range(ranks):
        sd = {}
        for name, shape in shapes.items():
            full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) + 1000 * len(name)
            parts = torch.tensor_split(full, ranks, dim=0)
            off = sum(p.shape[0] for p in parts[:r])
            sd[name] = Shards(shape, [((off,) + (0,) * (len(shape) - 1), parts[r])])
        for i in range(40):
            sd[f"layers.{i}.bias"] = Shards((4,), [((r,), torch.full((1,), float(i)))])
        sd["step"] = torch.tensor(3.0)
        sd["empty"] = torch.zeros((0, 5))
        import io

        buf = io.BytesIO()
        torch.save({"lr": 0.1, "rank": r}, buf)
        buf.seek(0)
        sd[f"extra/shard_{r}"] = buf
        per_rank.append(sd)
    save_ranks(folder, per_rank)
    return os.path.join(folder, ".metadata")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return _torch_written(str(tmp_path_factory.mktemp("dcp_fast")))


def test_torch_written_metadata_both_readers_agree(written):
    fast, general = _fast(written), _general(written)
    assert fast == general
    names = set(fast["tensors"])
    assert "model.norm\u2014w" in names and "model." + "x" * 300 in names
    assert len(fast["tensors"]["model.w"][2]) == 4
    assert fast["tensors"]["step"][1] == () and fast["tensors"]["empty"][1] == (0, 5)
    assert read_metadata(os.path.dirname(written)).readers == ("fast",)


def test_a_changed_number_changes_the_table(written, tmp_path):
    """The comparison can fail: one chunk's storage offset edited (by torch's own pickler) shows up
    in both readers, differently from the original."""
    import torch.distributed.checkpoint as dcp  # noqa: F401 (the classes the pickle names)

    folder = str(tmp_path / "edited")
    shutil.copytree(os.path.dirname(written), folder)
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    key = next(k for k in md.storage_data if k.fqn == "model.w" and k.offset[0] == 2)
    info = md.storage_data[key]
    md.storage_data[key] = type(info)(info.relative_path, info.offset + 8, info.length)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    before, after = _fast(written), _fast(path)
    assert after == _general(path)
    assert after["tensors"]["model.w"] != before["tensors"]["model.w"]


# -- hostile bytes ----------------------------------------------------------------------------


def flipped_bytes_agree(folder: str, buf: bytes, inside: list[int], n: int, monkeypatch) -> set[str]:
    """Write `folder`'s `.metadata` as `buf` in one frame with one byte of `n` positions of
    `inside` (offsets in `buf`, seed 29) set to each of 0x00, 0x94 (MEMOIZE), 0x68 (BINGET) and
    itself ^ 1; each time the specialised reader's outcome must be the general machine's.
    Returns the outcome kinds seen ("ok", "error")."""
    meta = os.path.join(folder, ".metadata")
    plain = b"\x80\x04\x95" + len(buf).to_bytes(8, "little") + buf  # one frame: positions are buf's + 11
    kinds = set()
    for i in np.random.default_rng(29).choice(inside, size=n, replace=False).tolist():
        for v in (0x00, 0x94, 0x68, buf[i] ^ 0x01):
            bad = bytearray(plain)
            bad[11 + i] = v
            with open(meta, "wb") as f:
                f.write(bad)
            kinds.add(same_outcome_as_the_general_machine(folder, monkeypatch, (i, v))[0])
    return kinds


def same_outcome_as_the_general_machine(folder: str, monkeypatch, what) -> tuple:
    """`_outcome` of the specialised reader, asserted equal to the general machine's alone
    (`what` names the case in the failure). Where the specialised reader gave up (`Fallback`),
    `read_metadata` already took the general machine's path, the very branch `general=True`
    forces: that outcome is the general machine's by construction, and is not computed a second
    time (about 3 in 4 damaged files fall back; the general machine is most of their time)."""
    fell = []
    real = dcp_fast.read

    def spy(data, path):
        try:
            return real(data, path)
        except dcp_fast.Fallback:
            fell.append(path)
            raise

    with monkeypatch.context() as mp:
        mp.setattr(dcp_fast, "read", spy)
        a = _outcome(folder, monkeypatch, general=False)
    if not fell:
        assert a == _outcome(folder, monkeypatch, general=True), what
    return a


def _outcome(folder: str, monkeypatch, *, general: bool):
    """`read_metadata`'s result (canonical) or its error line, by the specialised reader (falling
    back where it does) or by the general machine alone."""
    with monkeypatch.context() as mp:
        if general:
            def refuse(data, path):
                raise dcp_fast.Fallback

            mp.setattr(dcp_fast, "read", refuse)
        try:
            md = read_metadata(folder)
        except HybridCkptError as e:
            msg = str(e)
            assert "\n" not in msg and msg.startswith(folder)
            return ("error", type(e).__name__)
        except Exception as e:  # noqa: BLE001 - anything else is the failure being tested
            raise AssertionError(f"{folder}: {type(e).__name__}: {e}") from e
    rows = {
        f: (str(e.dtype), e.shape, [(c.offsets, c.sizes, c.path, c.offset, c.length) for c in e.chunks])
        for f, e in md.tensors.items()
    }
    return ("ok", rows, dict(md.bytes_items), repr(dict(md.planner_data)))  # repr: stubs have no ==


def _mutants(data: bytes, rng: np.random.Generator):
    """Truncations at 40 places, and byte flips at 60 random places (fixed seed)."""
    for cut in sorted(set(np.linspace(0, len(data) - 1, 40).astype(int).tolist())):
        yield f"cut{cut}", data[:cut]
    for i in rng.choice(len(data), size=min(60, len(data)), replace=False).tolist():
        for v in (0x00, 0x94, data[i] ^ 0x01):
            yield f"flip{i}={v}", data[:i] + bytes([v]) + data[i + 1 :]


@pytest.mark.parametrize("source", ["torch", "megatron", "torchtitan"])
def test_hostile_bytes_same_outcome_as_the_general_machine(source, written, tmp_path, monkeypatch):
    if source == "torch":
        path = written
    else:
        path = next(p for p in REAL_FILES if os.sep + ("megatron_core" if source == "megatron" else "torchtitan") in p)
    folder = str(tmp_path / "m")
    shutil.copytree(os.path.dirname(path), folder)
    with open(path, "rb") as f:
        data = f.read()
    meta = os.path.join(folder, ".metadata")
    ok = errors = 0
    for name, bad in _mutants(data, np.random.default_rng(29)):
        with open(meta, "wb") as f:
            f.write(bad)
        a = same_outcome_as_the_general_machine(folder, monkeypatch, name)
        ok += a[0] == "ok"
        errors += a[0] == "error"
    assert ok and errors  # both kinds of outcome were compared


def _pickled(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


@pytest.mark.parametrize(
    "bad",
    [
        _pickled(b"\x8d" + (1 << 62).to_bytes(8, "little")),  # BINUNICODE8 of 2**62 bytes
        _pickled(b"X" + (0xFFFFFFFF).to_bytes(4, "little")),  # BINUNICODE of 4 GiB
        _pickled(b"j" + (0xFFFFFFFF).to_bytes(4, "little")),  # LONG_BINGET far ahead
        _pickled(b"\x95" + (1 << 60).to_bytes(8, "little")),  # a FRAME longer than the file
        b"\x80\x04\x95" + (1 << 60).to_bytes(8, "little"),
        b"",
        b"\x80\x04",
        pickle.dumps([1, 2, 3], protocol=4),  # a pickle, not Metadata
        pickle.dumps({"state_dict_metadata": 1}, protocol=4),
    ],
)
def test_huge_counts_and_wrong_types_are_one_line(bad, tmp_path):
    (tmp_path / ".metadata").write_bytes(bad)
    with pytest.raises(HybridCkptError) as e:
        read_metadata(str(tmp_path))
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def _edited(written: str, tmp_path, edit) -> str:
    """A copy of the torch-written checkpoint whose Metadata `edit` changed (pickled by torch)."""
    import torch.distributed.checkpoint as dcp  # noqa: F401

    folder = str(tmp_path / "edit")
    shutil.copytree(os.path.dirname(written), folder)
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    return folder


def _huge_dim(md):
    e = md.state_dict_metadata["model.w"]
    c = e.chunks[0]
    e.chunks[0] = type(c)(offsets=c.offsets, sizes=type(c.sizes)((1 << 62, c.sizes[1])))


def _many_dims(md):
    import torch

    e = md.state_dict_metadata["model.w"]
    e.chunks[0] = type(e.chunks[0])(offsets=torch.Size((0,) * 65), sizes=torch.Size((1,) * 65))


def _string_dim(md):
    e = md.state_dict_metadata["model.w"]
    c = e.chunks[0]
    e.chunks[0] = type(c)(offsets=("0", 0), sizes=c.sizes)


def _negative_length(md):
    k = next(iter(md.storage_data))
    info = md.storage_data[k]
    md.storage_data[k] = type(info)(info.relative_path, info.offset, -5)


def _path_outside(md):
    k = next(iter(md.storage_data))
    info = md.storage_data[k]
    md.storage_data[k] = type(info)("../../etc/passwd", info.offset, info.length)


def _chunks_not_a_list(md):
    md.state_dict_metadata["model.w"].chunks = 7


@pytest.mark.parametrize("edit", [_huge_dim, _many_dims, _string_dim, _negative_length, _path_outside,
                                  _chunks_not_a_list])
def test_wrong_numbers_and_types_refused_by_both(edit, written, tmp_path, monkeypatch):
    folder = _edited(written, tmp_path, edit)
    a = _outcome(folder, monkeypatch, general=False)
    b = _outcome(folder, monkeypatch, general=True)
    assert a == b and a[0] == "error"


def test_one_chunk_fetched_again_and_again_is_refused_before_its_rows(written, tmp_path, monkeypatch):
    """A chunk list of 300k fetches of one 64-dim chunk object (5 bytes each in the pickle, 129
    numbers each in the table: 300 MiB from 1.5 MB) is refused by both readers by the numbers
    budget of the file's size, before the rows are made (the general machine's expansion
    budget, objects counted at every memo reference, refuses it first)."""
    import torch

    def bomb(md):
        e = md.state_dict_metadata["model.w"]
        c = type(e.chunks[0])(offsets=torch.Size((0,) * 64), sizes=torch.Size((0,) * 64))
        e.chunks = [c] * 300_000

    folder = _edited(written, tmp_path, bomb)
    for general in (False, True):
        with monkeypatch.context() as mp:
            if general:
                mp.setattr(dcp_fast, "read", lambda data, path: (_ for _ in ()).throw(dcp_fast.Fallback()))
            with pytest.raises(HybridCkptError, match="more chunk numbers than a file|past the budget"):
                read_metadata(folder)


# -- megatron's save plans: matched write items ----------------------------------------------


def _plan_spans(path: str):
    """The deframed pickle of `path` and, per call of the write-item matcher that matched, (start,
    end, memo size at start): read by the specialised machine, which must not fall back."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    frames = dcp_fast.deframe(data)
    buf = bytes(data)
    spans = []
    real = dcp_fast.plan_items

    def record(rec, pos):
        n0 = rec.memo_n
        end = real(rec, pos)
        if end != pos:
            spans.append((pos, end, n0))
        return end

    m = dcp_fast._Machine(buf, frames, path, RawTables())
    m.item_pattern = dcp_fast._ITEM_PATTERN
    dcp_fast.plan_items = record
    try:
        m.run()
    finally:
        dcp_fast.plan_items = real
    return buf, spans, m


@pytest.mark.parametrize("path", [p for p in REAL_FILES if "megatron_core" in p],
                         ids=lambda p: os.path.relpath(p, REAL).split(os.sep)[0])
def test_megatron_write_items_are_matched_records(path):
    """The plans' write items of every real megatron `.metadata` go through the record pattern
    (all but the first of each plan and a few the opcode loop reads), without falling back."""
    items = sum(len(vars(p)["items"]) for p in vars(safe_load_file(path, DCP_POLICY))["all_local_plans"])
    _, spans, m = _plan_spans(path)
    assert m.plan_lists and m.items_matched >= items // 2, (m.items_matched, items)
    assert read_metadata(os.path.dirname(path)).readers == ("fast",)


def test_damaged_write_items_same_outcome_as_the_general_machine(tmp_path, monkeypatch):
    """Byte flips inside matched write items, and a write item fetching a memo entry the
    specialised reader does not keep (another item's WriteItem object): the general machine's
    outcome; the latter is read, by the general machine (the specialised one falls back)."""
    path = next(p for p in REAL_FILES if "megatron_core_dense_dp" in p)
    buf, spans, _ = _plan_spans(path)
    folder = str(tmp_path / "m")
    shutil.copytree(os.path.dirname(path), folder)
    assert flipped_bytes_agree(folder, buf, [i for s, e, _ in spans for i in range(s, e)], 40, monkeypatch) == {"ok", "error"}
    meta = os.path.join(folder, ".metadata")
    plain = b"\x80\x04\x95" + len(buf).to_bytes(8, "little") + buf
    # the second matched run's first item: its type fetch now names the first run's WriteItem
    (_, _, n_prev), (s1, _, _) = spans[0], spans[1]
    d = dcp_fast._ITEM_PATTERN.match(buf, s1).groupdict()
    at = dcp_fast._ITEM_PATTERN.match(buf, s1).start("type")
    assert d["type"][:1] == b"j"
    bad = bytearray(plain)
    bad[11 + at : 11 + at + 5] = b"j" + n_prev.to_bytes(4, "little")
    with open(meta, "wb") as f:
        f.write(bad)
    a = _outcome(folder, monkeypatch, general=False)
    assert a[0] == "ok" and a == _outcome(folder, monkeypatch, general=True)
    assert read_metadata(folder).readers == ("general",)
    with open(meta, "wb") as f:
        f.write(plain)
    assert read_metadata(folder).readers == ("fast",)  # one frame, undamaged: the fast reader
