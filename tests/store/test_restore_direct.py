"""A restore of our store at the read floor, cold and warm (issue 42).

Cold (the chunk files' pages dropped): each chunk file, or the piece of it a device needs, is read
with O_DIRECT straight into the shard's buffer (`io.direct_read`), not through fresh page-cache
pages; warm (the page cache holds them): read buffered, as before, never from the device again.
Either way every chunk is still checked against its CRC-32 (a damaged byte is caught), and the
arrays placed on the CPU devices are the buffers the chunks were read into, not copies of them
(`lazy.parallel.read_box_parallel` allocates them 4 KiB-aligned, and `jax.device_put` on a CPU
device takes an aligned host array without a copy: before, each restored array was copied once
more, the extra peak memory of a restore). Everything is counted: bytes read with O_DIRECT
(`count_reads`, `(path, "direct")`), O_DIRECT opens, buffer addresses; never timed.

The source is an HF Llama folder written by safetensors, imported onto fsdp=2,tp=2 and restored
onto fsdp=4, which cuts every stored kernel chunk in two (on its first axis for q/k/v/gate/up
and lm_head, across its rows for o/down/embed). Reads of at least 4 KiB may go direct here
(`DIRECT_MIN_BYTES`, 256 KiB by default, lowered for these small chunks).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from fixtures.direct_probe import cold_reads_supported
from fixtures.direct_probe import drop_pages as drop
from fixtures.smaps import mapping_of
from meshes import fit, fit_pair
from safetensors.numpy import load_file, save_file

import hybridckpt
from hybridckpt import naming
from hybridckpt.errors import CheckpointError
from hybridckpt.io import direct_read, page_advice
from hybridckpt.io.byte_source import close_all, count_reads
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.lazy import parallel

D, FFN, HEADS, KV, LAYERS, VOCAB = 256, 512, 4, 2, 2, 500  # (lm_head rows of 1000 bytes: bounced)
SAVED, TARGET = "fsdp=2,tp=2", "fsdp=4"
MIN_BYTES = 4096


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
    root = tmp_path_factory.mktemp("direct")
    src = root / "src"
    src.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
           "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "torch_dtype": "float32", "hidden_act": "silu"}
    (src / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(3)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes().items()},
              str(src / "model.safetensors"))
    ck = str(root / "ck")
    import_checkpoint(str(src), ck, mesh=fit(SAVED))
    return str(src), ck, cold_reads_supported(str(root))


@pytest.fixture(autouse=True)
def small_reads_direct(monkeypatch):
    monkeypatch.setattr(direct_read, "DIRECT_MIN_BYTES", MIN_BYTES)
    parallel.set_io_threads(4)
    yield
    parallel.set_io_threads(None)
    close_all()


@pytest.fixture
def direct_opens(monkeypatch):
    count, real = [0], os.open

    def counted(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            count[0] += 1
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", counted)
    return count


def chunk_files(ck: str) -> list[str]:
    step = next(d for d in os.listdir(ck) if d.isdigit())
    params = os.path.join(ck, step, "params")
    return sorted(os.path.join(params, a, f) for a in os.listdir(params) if os.path.isdir(os.path.join(params, a))
                  for f in os.listdir(os.path.join(params, a)) if f[0].isdigit())


def drop_pages(files: list[str]) -> None:
    for p in files:
        drop(p)


def same_as_source(src: str, cfg, params) -> None:
    want = load_file(os.path.join(src, "model.safetensors"))
    back = naming.tree_to_hf(jax.tree.map(np.asarray, params), cfg)
    assert set(back) == set(want)
    for k, v in want.items():
        got = back[k].materialize()
        assert got.dtype == v.dtype and got.tobytes() == v.tobytes(), k


def restore_counted(ck: str):
    with count_reads() as counter:
        cfg, r = hybridckpt.restore(ck, fit_pair(fit(SAVED), TARGET)[1], profile=True)
    return cfg, r, counter


def test_a_cold_restore_reads_every_chunk_with_o_direct(store, direct_opens):
    """Pages dropped: every chunk file piece of at least MIN_BYTES is read with O_DIRECT (the
    1 KiB norm chunks stay buffered), each byte once, each checked; the values are the source's.
    Before: no byte read direct."""
    src, ck, capable = store
    files = chunk_files(ck)
    drop_pages(files)
    cfg, r, counter = restore_counted(ck)
    same_as_source(src, cfg, r.params)
    read = {p: counter[p] for p in files if counter[p]}
    direct = {p: counter[(p, "direct")] for p in files if counter[(p, "direct")]}
    big = {p: n for p, n in read.items() if os.path.getsize(p) >= 2 * MIN_BYTES}  # (a piece: half a chunk)
    assert big and len(big) < len(read)  # (both kinds here)
    assert direct == (big if capable else {})
    assert direct_opens[0] >= (len(big) if capable else 0)
    assert r.profile.stage("checksum").bytes == sum(read.values()) == sum(os.path.getsize(p) for p in read)


def test_a_warm_restore_reads_through_the_page_cache(store, direct_opens):
    """The page cache holds the chunk files: no O_DIRECT open, no byte read direct (it would be
    read from the device again)."""
    src, ck, _ = store
    for p in chunk_files(ck):
        with open(p, "rb") as f:
            f.read()
    cfg, r, counter = restore_counted(ck)
    same_as_source(src, cfg, r.params)
    assert not any(v for k, v in counter.items() if isinstance(k, tuple) and k[1] == "direct")
    assert direct_opens[0] == 0


@pytest.mark.parametrize(("array", "at"), [("layers.up.kernel", 3 * 1024 + 8),  # a piece read into its shard's rows
                                           ("layers.down.kernel", 200 * 512 + 4),  # a chunk read whole, cut in memory
                                           ("lm_head.kernel", 100 * 1000 + 12)])  # rows of odd length: bounced
def test_a_damaged_byte_read_with_o_direct_is_caught(store, tmp_path, array, at):
    _, ck, _ = store
    bad = str(tmp_path / "ck")
    shutil.copytree(ck, bad)
    step = next(d for d in os.listdir(bad) if d.isdigit())
    path = os.path.join(bad, step, "params", array, "0.0.0" if array.startswith("layers") else "0.0")
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))
    drop_pages(chunk_files(bad))
    with pytest.raises(CheckpointError, match=re.escape(array) + r": chunk 0\.0.* CRC-32"):
        restore_counted(bad)


def test_the_placed_arrays_are_the_buffers_read_not_copies(store, monkeypatch):
    """Each shard on a CPU device is the very buffer its box was read into (one per distinct
    box; replicated boxes share it), whether filled by chunks (`store.chunk_fill`) or box by box:
    before, numpy's unaligned buffers were each copied by `jax.device_put`."""
    from hybridckpt.store import chunk_fill

    src, ck, _ = store
    buffers: set[int] = set()
    real, plan = parallel.read_box_parallel, chunk_fill.ArrayFill.plan

    def recorded(t, box=None, out=None):
        got = real(t, box, out)
        buffers.add(got.ctypes.data)
        return got

    def planned(self):
        ok = plan(self)
        buffers.update(b.ctypes.data for b in self.buffers.values())
        return ok

    monkeypatch.setattr(parallel, "read_box_parallel", recorded)
    monkeypatch.setattr(chunk_fill.ArrayFill, "plan", planned)
    cfg, r, _ = restore_counted(ck)
    same_as_source(src, cfg, r.params)
    placed = {s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(r.params) for s in a.addressable_shards}
    assert placed and placed <= buffers, len(placed - buffers)


def test_the_placed_arrays_are_backed_by_small_pages(store, monkeypatch):
    """Each shard's buffer is marked MADV_NOHUGEPAGE before it is read into (`io.page_advice`;
    the threshold lowered to a page for these small shards): its mapping carries the kernel's
    `nh` flag and holds no huge page. Before, numpy's own MADV_HUGEPAGE stood on every shard of
    4 MiB or more, and the kernel zeroed 2 MiB pages at their first touch (37-43% of a warm
    1.1 GB restore's CPU samples on the 2-core VM)."""
    monkeypatch.setattr(page_advice, "MIN_BYTES", page_advice.PAGE_BYTES)
    src, ck, _ = store
    cfg, r, _ = restore_counted(ck)
    same_as_source(src, cfg, r.params)
    shards = [s.data for a in jax.tree.leaves(r.params) for s in a.addressable_shards if s.data.nbytes >= 1 << 16]
    assert len(shards) > 8
    for s in shards:
        m = mapping_of(s.unsafe_buffer_pointer())
        # (the mark only: whether the kernel then faults small pages is checked in a fresh process
        # by tests/io/test_page_advice.py; here, in a worker that ran other tests, a shard may sit
        # in heap memory an earlier array had already faulted in as huge pages)
        assert "nh" in m["flags"], (s.shape, m)
