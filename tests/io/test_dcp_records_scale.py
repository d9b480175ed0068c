"""The specialised `.metadata` reader's records at scale: tensor heads (`containers.dcp_heads`)
and write items whose entries are rebuilt only when fetched (`containers.dcp_plans`).

- A many-rank Megatron-Core torch_dist `.metadata` (`benchmarks/scale_torch_dist.py`: torch's
  own objects pickled by torch's `FileSystemWriter`, byte-identical to megatron-core's at the
  real case's size) is read by records: the work the opcode loop does one opcode at a time is
  counted (`Records.ops`), never timed; both readers give the same tables.
- Byte flips inside matched tensor heads get the general machine's outcome.
- A write item fetching another item's TensorProperties (an entry the general machine holds,
  which the specialised reader rebuilds from the item's bytes) is read by the specialised reader
  and agrees; a fetch of an entry it does not keep (the item's TensorWriteData) falls back.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from test_dcp_fast import REAL_FILES, _fast, _general, _outcome, flipped_bytes_agree

from hybridckpt.containers import dcp_fast
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.containers.dcp_records import _size_value
from hybridckpt.containers.dcp_tables import RawTables

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import scale_torch_dist as std  # noqa: E402

MEGATRON = next(p for p in REAL_FILES if "megatron_core_dense_dp" in p)


def _machine(path: str, heads: list | None = None):
    """The specialised machine run over `path` (must not fall back); `heads` collects the matched
    tensor heads' (start, end)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    frames = dcp_fast.deframe(data)
    buf = bytes(data)
    m = dcp_fast._Machine(buf, frames, path, RawTables())
    if b"WriteItem" in buf:
        m.item_pattern = dcp_fast._ITEM_PATTERN
    real = dcp_fast.tensor_head

    def record(rec, pos):
        end = real(rec, pos)
        if end != pos and heads is not None:
            heads.append((pos, end))
        return end

    dcp_fast.tensor_head = record
    try:
        md = m.run()
    finally:
        dcp_fast.tensor_head = real
    return buf, m, md


@pytest.fixture(scope="module", params=[1, 4], ids=["dp1", "dp4"])
def many_ranks(request, tmp_path_factory):
    """A torch_dist save of a 4-layer model on TP 2 x PP 2 x DP 1 or 4 (DP 1: every bucket tensor
    one chunk, pickled without a MARK)."""
    root = tmp_path_factory.mktemp("td")
    model = dict(std.LIKE_REAL, num_layers=4, hidden_size=32, ffn_hidden_size=48, padded_vocab_size=128,
                 vocab_size=120, bf16=True, overlap_grad_reduce=True)
    std.write(str(root), model, 2, 2, request.param, holes=True, log=lambda _s: None)
    return str(root / "iter_0000001" / ".metadata")


def test_many_rank_torch_dist_is_read_by_records(many_ranks):
    """Every tensor head but the first of each dtype (its dtype is a global the loop reads; the
    first one's names too) and every write
    item but each plan's first is a matched record; each matched head is 33 opcodes or more the
    loop does not read (`Records.ops`: at 288 ranks of Llama 3.1 405B, 414k -> 97k)."""
    _, m, md = _machine(many_ranks)
    sdm = vars(md)["state_dict_metadata"]
    tsm = [v for v in sdm.values() if type(v).stub_name == "TensorStorageMetadata"]
    dtypes = {repr(vars(v.properties)["stub_state"][0]) for v in tsm}
    plans = vars(md)["all_local_plans"]
    items = sum(len(vars(p)["items"]) for p in plans)
    assert len(dtypes) == 2 and m.heads_matched == len(tsm) - len(dtypes)
    assert m.items_matched >= items - len(plans), (m.items_matched, items)
    assert len(m.chunk_idx) == len(m.raw.c_nd) - 1  # every chunk but the first a matched record
    # the loop's opcodes: a few a key (the rest of each value, byte items) and the first records;
    # ~45 a key before the heads, and a whole SETITEMS batch after any entry the loop read
    assert m.ops < 20 * len(sdm), (m.ops, len(sdm))
    dcp_fast_head = dcp_fast.tensor_head
    dcp_fast.tensor_head = lambda rec, pos: pos  # no heads: the loop reads them
    try:
        _, m0, _ = _machine(many_ranks)
    finally:
        dcp_fast.tensor_head = dcp_fast_head
    assert m0.heads_matched == 0 and m.ops + 33 * m.heads_matched <= m0.ops, (m.ops, m0.ops)
    assert _fast(many_ranks) == _general(many_ranks)
    assert read_metadata(os.path.dirname(many_ranks)).readers == ("fast",)


@pytest.mark.parametrize("path", [MEGATRON, next(p for p in REAL_FILES if "torchtitan" in p)],
                         ids=["megatron", "torchtitan"])
def test_flips_inside_tensor_heads_same_outcome_as_the_general_machine(path, tmp_path, monkeypatch):
    heads: list = []
    buf, _, _ = _machine(path, heads)
    assert len(heads) >= 15
    folder = str(tmp_path / "m")
    shutil.copytree(os.path.dirname(path), folder)
    assert flipped_bytes_agree(folder, buf, [i for s, e in heads for i in range(s, e)], 30, monkeypatch) == {"ok", "error"}


def _entries(m, k: int) -> dict:
    """Memo indices of write item k's TensorWriteData and (inline) TensorProperties."""
    n0, pos = m.item_idx[k], m.item_pos[k]
    mm = m.item_pattern.match(m.buf, pos)
    d = mm.groupdict()
    n = n0 + 4 + (d["fqn_n"] is not None)
    if d["size1"] is not None:
        n += 3 if _size_value(mm, m.item_pattern.groupindex["o_run"], {}) else 2
    return {"twd": n, "tp": n + 2 if d["tp"] is not None else None}


def test_a_fetch_of_an_items_entry_is_rebuilt_or_falls_back(tmp_path, monkeypatch):
    buf, m, _ = _machine(MEGATRON)
    ks = range(len(m.item_idx))
    first = next(k for k in ks if _entries(m, k)["tp"] is not None)
    later = next(k for k in ks if k > first and (
        m.item_pattern.match(buf, m.item_pos[k]).group("props") or b"")[:1] == b"j")
    at = m.item_pattern.match(buf, m.item_pos[later]).start("props")
    folder = str(tmp_path / "m")
    shutil.copytree(os.path.dirname(MEGATRON), folder)
    meta = os.path.join(folder, ".metadata")
    plain = b"\x80\x04\x95" + len(buf).to_bytes(8, "little") + buf
    for what, readers in (("tp", ("fast",)), ("twd", ("general",))):
        i = _entries(m, first)[what]
        bad = bytearray(plain)
        bad[11 + at : 11 + at + 5] = b"j" + i.to_bytes(4, "little")
        with open(meta, "wb") as f:
            f.write(bad)
        a = _outcome(folder, monkeypatch, general=False)
        assert a[0] == "ok" and a == _outcome(folder, monkeypatch, general=True), what
        assert read_metadata(folder).readers == readers, what
        if what == "tp":  # rebuilt once, then held: the general machine's object for that entry
            _, m2, _ = _machine(meta)
            props = m2.memo[i]
            assert type(props).stub_name == "TensorProperties" and m2.memo[i + 1] == props.stub_state
