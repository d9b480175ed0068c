"""torchtitan 0.3 Qwen3-MoE and DeepSeek V3: grouped experts sharded over experts (EP) and FSDP in a
real DCP save, taken apart per expert into HF's names with their moments; bad expert offsets and
dropped experts; import -> restore -> export bitwise and logits equal transformers'.

The fixture is written once per module by torch's real `dcp.save` on 4 gloo ranks, the experts
DTensors `[_StridedShard(0), Shard(0)]` over (efsdp, ep), one expert per rank, the layout
torchtitan 0.3.0's own save has (tests/real/cases/torchtitan_qwen3_moe, checked against
torchtitan itself in tests/real/test_real_torchtitan.py; tests/fixtures/titan_moe_writer.py
cites the torchtitan code it follows), from transformers' own `Qwen3MoeForCausalLM` trained 3
AdamW steps; references are what torch computed (params, moments, the next step's gradients and
params, under the per-expert names transformers' `save_pretrained` writes). DeepSeek V3 here is
still written only from a reading of torchtitan's code (no real case yet).
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import types

import numpy as np
import pytest
import torch
from e2e import assert_same, roundtrip
from fixtures import FIXTURES
from fixtures.ckpt_checks import optax_next, run_writer
from fixtures.torch_common import load_reference, reference_names
from meshes import fit, fit_pair
from safetensors.numpy import load_file

from hybridckpt import jobs, lazy, naming
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.errors import FormatError
from hybridckpt.formats import dcp
from hybridckpt.formats.dcp import torchtitan
from hybridckpt.formats.model_config import load_config_file
from hybridckpt.formats.registry import detect
from hybridckpt.io.byte_source import count_reads
from hybridckpt.rules import parse_rules

WRITER = os.path.join(FIXTURES, "titan_moe_writer.py")
NAME = "qwen3_moe"
HEADS, KV, EXPERTS = 4, 2, 4  # titan_moe_writer.SIZES
W1 = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
GATE = "model.layers.{}.mlp.experts.{}.gate_proj.weight"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("titan_moe")
    run_writer(WRITER, out)
    return str(out)


@pytest.fixture(scope="module")
def root(written):
    return os.path.join(written, NAME)


@pytest.fixture(scope="module")
def ds_root(written):
    return os.path.join(written, "deepseek_v3")


def _step(root) -> str:
    return os.path.join(root, "checkpoint", "step-3")


def _to_hf(src, tensors, slots=None):
    """torchtitan names -> HF names by the source's own rules (the split of the fused q/k/v
    needs the head counts, from HF's config.json here)."""
    rules = parse_rules(src.hf_rules, {**src.rule_vars, "tied": False})
    tensors = torchtitan.split_fused_qkv(tensors, HEADS, KV)
    res = rules.apply(tensors)
    if slots is None:  # gradients: no buffer (expert bias) to drop
        return res.tensors, None
    assert res.report() == []
    out = {}
    for s, t in slots.items():
        r = rules.apply(torchtitan.split_fused_qkv(t, HEADS, KV), strict=False)
        out[s] = r.tensors
    return res.tensors, out


def _open_hf(path):
    src = dcp.open(path)
    params, slots = _to_hf(src, src.tensors, src.optimizer.slots)
    return src, params, slots


# -- the fixture is what torchtitan writes, and transformers' per-expert checkpoint -------------


def test_fixture_layout_is_torchtitan_moe_with_experts_split_over_ranks(root):
    md = read_metadata(_step(root))
    e = md.tensors[W1]
    assert e.shape == (EXPERTS, 16, 32)  # [experts, hidden, dim]
    # EP and FSDP both on the expert axis: one whole expert per chunk, ranks 0..3 holding experts
    # 0, 2, 1, 3 (as torchtitan's own save, tests/real/cases/torchtitan_qwen3_moe)
    assert [tuple(c.offsets) for c in e.chunks] == [(0, 0, 0), (2, 0, 0), (1, 0, 0), (3, 0, 0)]
    assert all(tuple(c.sizes) == (1, 16, 32) for c in e.chunks)
    assert md.tensors[f"optimizer.state.{W1}.exp_avg"].shape == (EXPERTS, 16, 32)
    assert len(md.tensors[f"optimizer.state.{W1}.exp_avg"].chunks) == 4
    assert md.tensors["layers.1.moe.routed_experts.inner_experts.w2_EDF"].shape == (EXPERTS, 32, 16)
    assert (
        "layers.0.moe.expert_bias_E" in md.tensors
        and "layers.0.moe.router.gate.weight" in md.tensors
    )
    assert not any(".feed_forward." in k or ".mlp." in k for k in md.tensors)
    # the reference's per-expert names and values are transformers' own save_pretrained file
    ref, _ = load_reference(root, NAME)
    saved = load_file(os.path.join(root, "hf", "model.safetensors"))
    assert sorted(saved) == reference_names(ref, "param")
    for k, v in saved.items():
        assert np.array_equal(v, ref[f"param/{k}"]), k


# -- names, experts and moments: bit for bit ---------------------------------------------------


def test_params_and_moments_exact_under_hf_per_expert_names(root):
    assert detect(os.path.join(root, "checkpoint")) == "dcp"
    src, params, slots = _open_hf(os.path.join(root, "checkpoint"))
    ref, _ = load_reference(root, NAME)
    assert sorted(params) == reference_names(ref, "param")  # every expert, nothing else
    assert src.step == src.optimizer.step == 3
    for k, t in params.items():
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k
        for slot in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(slots[slot][k].materialize(), ref[f"{slot}/{k}"]), (slot, k)
    # the expert bias is dropped as torchtitan's Qwen3 to_hf drops it, and the reader says so
    assert any("expert bias" in n and "max |bias| 0.02" in n for n in src.notes)
    # experts are read lazily, each from its own chunk (expert 3: rank 3's file)
    view = src.tensors["layers.0.moe.experts.3.w1.weight"]
    assert isinstance(view, lazy.LazyTensor) and view.shape == (16, 32)


def test_grouped_experts_are_split_on_the_leading_axis_not_a_transpose(root):
    """w1_EFD[e] is expert e's gate_proj ([hidden, dim] = HF's [out, in]); other cuts of the same
    bytes give other values (the check can fail)."""
    src = dcp.open(_step(root))
    ref, _ = load_reference(root, NAME)
    whole = np.stack(
        [src.tensors[f"layers.0.moe.experts.{e}.w1.weight"].materialize() for e in range(EXPERTS)]
    )
    want = np.stack([ref[f"param/{GATE.format(0, e)}"] for e in range(EXPERTS)])
    assert np.array_equal(whole, want)
    assert not np.array_equal(whole.reshape(EXPERTS * 16, 32)[::EXPERTS], want[0])
    up = src.tensors["layers.0.moe.experts.1.w3.weight"].materialize()
    assert not np.array_equal(up, ref[f"param/{GATE.format(0, 1)}"])  # w3 is up, not gate


# -- one optax step equals torch AdamW's next step --------------------------------------------


def test_optax_step_matches_torch_adamw(root):
    """The next step's gradients, in torchtitan's parameter layout (fused wqkv, grouped experts),
    go through the same splits and rules as the moments; one optax AdamW step from the imported
    params and moments then equals torch's, expert by expert."""
    src, params, slots = _open_hf(_step(root))
    ref, _ = load_reference(root, NAME)
    grads = {k: lazy.ArrayTensor(ref[f"grad/{k}"]) for k in reference_names(ref, "grad")}
    assert W1 in grads
    counts = torchtitan.expert_counts(grads, EXPERTS, "grads")
    grads = torchtitan.split_experts(grads, counts, "grads")
    grads = {k: t.materialize() for k, t in _to_hf(src, grads)[0].items()}
    assert sorted(grads) == sorted(params)
    opt = types.SimpleNamespace(hyper=src.optimizer.hyper, slots=slots)
    new = optax_next(params, opt, grads, src.optimizer.step)
    for k, got in new.items():
        want = ref[f"next/{k}"]
        assert np.max(np.abs(want - ref[f"param/{k}"])) > 1e-5, k  # the step really moves it
        np.testing.assert_allclose(
            got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))), err_msg=k
        )


# -- the whole path, with the Qwen3-MoE family ----------------------------------------------------


def _config(root) -> str:
    return os.path.join(root, "hf", "config.json")


def _torch_logits(root) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, transformers' logits of the trained model as it saved itself), fp32 eager."""
    import json

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(root, "hf"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with open(os.path.join(root, "tokens.json")) as f:
        tokens = np.array(json.load(f), dtype=np.int32)
    with torch.no_grad():
        return tokens, model(torch.from_numpy(tokens).long()).logits.numpy()


def test_import_restore_export_bitwise_and_logits_with_experts_over_dp(root, tmp_path):
    """torchtitan -> Orbax on mesh A -> restore on mesh B (experts split over dp) -> export:
    bitwise torch's params and moments under HF's per-expert names; the imported model's logits
    equal transformers' (fp32, 1e-4)."""
    ref, _ = load_reference(root, NAME)
    mesh_b, mesh_a = fit_pair("dp=4,fsdp=2", "dp=2,tp=2,pp=2", keep="dp")  # mesh B keeps dp first
    params, mu, nu, step = roundtrip(
        os.path.join(root, "checkpoint"),
        str(tmp_path),
        mesh_a=mesh_a,
        mesh_b=mesh_b,
        config=_config(root),
    )
    assert_same(params, {k: ref[f"param/{k}"] for k in reference_names(ref, "param")})
    assert_same(mu, {k: ref[f"exp_avg/{k}"] for k in params}, "exp_avg")
    assert_same(nu, {k: ref[f"exp_avg_sq/{k}"] for k in params}, "exp_avg_sq")
    assert step == 3
    tokens, want = _torch_logits(root)
    got = jobs.logits(os.path.join(str(tmp_path), "orbax"), tokens, mesh=mesh_b)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# -- a wrong expert offset, a dropped expert ---------------------------------------------------


def _edited_copy(root, tmp_path, edit) -> str:
    """A copy of the step folder whose `.metadata` (torch's own Metadata object, pickled as
    torch's FileSystemWriter does) was changed by `edit(metadata)`."""
    from torch.distributed.checkpoint import FileSystemReader

    out = str(tmp_path / "step-3")
    shutil.copytree(_step(root), out)
    md = FileSystemReader(out).read_metadata()
    edit(md)
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return out


def _swap_expert_blocks(md):
    """Rank files swapped for experts 0 <-> 2 and 1 <-> 3 of w1_EFD: the blocks tile the tensor
    exactly, at the wrong expert offsets."""
    keys = {tuple(k.offset): k for k in md.storage_data if k.fqn == W1}
    for e in (0, 1):
        a, b = keys[(e, 0, 0)], keys[(e + 2, 0, 0)]
        md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]


def test_wrong_expert_offsets_give_other_experts_and_the_comparison_sees_it(root, tmp_path):
    path = _edited_copy(root, tmp_path, _swap_expert_blocks)
    src, params, _ = _open_hf(path)
    ref, _ = load_reference(root, NAME)
    for e in range(EXPERTS):
        got = params[GATE.format(0, e)].materialize()
        assert np.array_equal(got, ref[f"param/{GATE.format(0, (e + 2) % EXPERTS)}"])
        assert not np.array_equal(got, ref[f"param/{GATE.format(0, e)}"])
    # imported anyway (the blocks tile the tensor), the model's logits move far off transformers'
    jobs.import_checkpoint(path, str(tmp_path / "orbax"), mesh=fit("dp=2,fsdp=2", keep="dp"), config=_config(root))
    tokens, want = _torch_logits(root)
    got = jobs.logits(str(tmp_path / "orbax"), tokens, mesh=fit("dp=2,fsdp=2", keep="dp"))
    assert np.abs(got - want).max() > 1000 * 1e-4


def test_an_expert_block_at_an_overlapping_offset_is_refused(root, tmp_path):
    def overlap(md):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        chunks = md.state_dict_metadata[W1].chunks
        i = next(i for i, c in enumerate(chunks) if tuple(c.offsets) == (2, 0, 0))
        chunks[i] = ChunkStorageMetadata(offsets=torch.Size([1, 0, 0]), sizes=chunks[i].sizes)
        old = MetadataIndex(W1, torch.Size([2, 0, 0]))
        md.storage_data[MetadataIndex(W1, torch.Size([1, 0, 0]))] = md.storage_data.pop(old)

    path = _edited_copy(root, tmp_path, overlap)
    with pytest.raises(FormatError, match=W1.replace(".", r"\.")):
        dcp.open(path)


def test_dropped_experts_are_refused_against_the_router(root, tmp_path):
    """A save that lost the experts of one EP rank (the tensor recorded as 2 experts) no longer
    matches the 4 rows of its layer's router: one line naming the key, expected and found."""

    def drop(md):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = md.state_dict_metadata[W1]
        kept = [c for c in meta.chunks if c.offsets[0] < 2]
        md.state_dict_metadata[W1] = TensorStorageMetadata(
            meta.properties, torch.Size([2, 16, 32]), kept
        )
        for k in [k for k in md.storage_data if k.fqn == W1 and k.offset[0] >= 2]:
            del md.storage_data[k]

    path = _edited_copy(root, tmp_path, drop)
    with pytest.raises(FormatError, match=r"w1_EFD' is \(2, 16, 32\); expected \[4, \.\.\.\]"):
        dcp.open(path)
    # and the config's count is checked against the router's rows
    grouped = {W1: lazy.ArrayTensor(np.zeros((4, 16, 32), np.float32))}
    router = {"layers.0.moe.router.gate.weight": lazy.ArrayTensor(np.zeros((4, 32), np.float32))}
    assert torchtitan.expert_counts({**grouped, **router}, 4, "x") == {"layers.0": 4}
    with pytest.raises(FormatError, match="routes to 4 experts; the config says 8"):
        torchtitan.expert_counts({**grouped, **router}, 8, "x")


# -- DeepSeek V3: MLA names, a dense first layer, shared experts, the correction bias -----------


def test_deepseek_v3_params_and_moments_exact_under_hf_names(ds_root):
    """torchtitan's DeepSeek V3 names (wq_a/q_norm/wq_b, wkv_a/kv_norm/wkv_b, a dense
    `feed_forward` layer, `moe.shared_experts`, `moe.expert_bias_E`, an MTP layer) are HF's by
    torchtitan's adapter, bit for bit; the bias is a buffer: its moments are zeros."""
    cfg = load_config_file(_config(ds_root))
    src = dcp.open(os.path.join(ds_root, "checkpoint"), config=cfg)
    ref, _ = load_reference(ds_root, "deepseek_v3")
    hf = naming.source_to_hf(src, cfg)
    assert hf.report == ()
    assert sorted(hf.params) == reference_names(ref, "param")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert np.abs(ref[f"param/{bias}"]).max() > 0.01  # drawn (transformers starts it at 0)
    for k, t in hf.params.items():
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k
        for slot in ("exp_avg", "exp_avg_sq"):
            want = (
                np.zeros_like(ref[f"param/{k}"])
                if k.endswith("correction_bias")
                else ref[f"{slot}/{k}"]
            )
            assert np.array_equal(hf.slots[slot][k].materialize(), want), (slot, k)
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in hf.params
    assert "model.layers.0.mlp.gate_proj.weight" in hf.params  # first_k_dense_replace = 1
    # the MTP module `mtp_layers.0` is HF's layer 3 (after the 3 main layers), whole, with the
    # main embedding and head it shares in torchtitan as its embed_tokens / shared_head.head
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in hf.params
    assert "model.layers.3.shared_head.norm.weight" in hf.params
    emb = hf.params["model.layers.3.embed_tokens.weight"].materialize()
    assert np.array_equal(emb, ref["param/model.embed_tokens.weight"])
    assert any("MTP layers [0]" in n for n in src.notes)
    assert any("e_score_correction_bias" in n and "zero moments" in n for n in src.notes)


def test_deepseek_v3_import_restore_export_bitwise_and_logits(ds_root, tmp_path):
    ref, _ = load_reference(ds_root, "deepseek_v3")
    mesh_a, mesh_b = fit_pair("dp=2,tp=4", "dp=2,fsdp=2,tp=2", keep="dp")
    params, mu, nu, step = roundtrip(
        os.path.join(ds_root, "checkpoint"),
        str(tmp_path),
        mesh_a=mesh_a,
        mesh_b=mesh_b,
        config=_config(ds_root),
    )
    assert_same(params, {k: ref[f"param/{k}"] for k in reference_names(ref, "param")})
    moments = {k for k in params if not k.endswith("correction_bias")}
    assert_same({k: mu[k] for k in moments}, {k: ref[f"exp_avg/{k}"] for k in moments}, "exp_avg")
    assert_same(
        {k: nu[k] for k in moments}, {k: ref[f"exp_avg_sq/{k}"] for k in moments}, "exp_avg_sq"
    )
    assert step == 3
    tokens, want = _torch_logits(ds_root)
    got = jobs.logits(os.path.join(str(tmp_path), "orbax"), tokens, mesh=mesh_b)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# -- reads: every expert's bytes once ------------------------------------------------------------


def test_each_experts_bytes_are_read_once(root, tmp_path):
    """The per-expert views of a grouped tensor read exactly its bytes (once the chunk archives
    are parsed), and a whole import reads every tensor's bytes once plus each chunk's two ends
    (its archive's headers) once: nothing twice, nothing materialised whole."""
    with count_reads() as c:
        src = dcp.open(_step(root))
    opening = sum(v for k, v in c.items() if isinstance(k, str) and k.endswith(".distcp"))  # its bytes items
    views = [src.tensors[f"layers.0.moe.experts.{e}.w1.weight"] for e in range(EXPERTS)]
    for v in views:  # parse each expert's chunk archives (zip directory, pickle)
        v.read_box(((0, 1), (0, 1)))
        v.read_box(((15, 16), (0, 1)))
    with count_reads() as c:
        got = [v.materialize() for v in views]
    assert sum(v for k, v in c.items() if isinstance(k, str)) == EXPERTS * 16 * 32 * 4
    ref, _ = load_reference(root, NAME)
    assert all(np.array_equal(g, ref[f"param/{GATE.format(0, e)}"]) for e, g in enumerate(got))
    md = read_metadata(_step(root))
    entries = [e for k, e in md.tensors.items() if not k.endswith(".step")]
    data = sum(math.prod(e.shape) * e.dtype.itemsize for e in entries)
    with count_reads() as c:
        jobs.import_checkpoint(
            os.path.join(root, "checkpoint"),
            str(tmp_path / "o"),
            mesh=fit("dp=4,fsdp=2", keep="dp"),
            config=_config(root),
        )
    read = sum(v for k, v in c.items() if isinstance(k, str) and k.endswith(".distcp"))
    # plus each chunk's two ends, once (`.step`'s too): its first and last `rest` bytes, `rest` =
    # its bytes that are not elements (~1.5 KiB: zip headers and directory, pickle), wherever the
    # elements lie (`formats/dcp/chunk`; the whole chunk when they meet): ~2 * rest a chunk where a
    # parse of the archive alone read ~1 KiB, so that the reads do not depend on which chunks were
    # read before and the import's equal its plan's (tests/jobs/test_import_cut_reads.py); plus
    # what opening the source reads (the optimizer's param groups, bytes items), at most once
    ends = sum(min(k.length, 2 * (k.length - math.prod(k.sizes) * e.dtype.itemsize))
               for e in md.tensors.values() for k in e.chunks)
    assert ends <= 2 * 2048 * len([k for e in md.tensors.values() for k in e.chunks])
    assert data + ends <= read <= data + ends + opening, (read, data, ends, opening)


def test_inspect_counts_each_grouped_tensors_chunks_once(root, monkeypatch):
    """`inspect` lists every expert of a grouped tensor as its own view (`split_experts`); the
    views' pieces are the grouped tensor's chunks, counted once per grouped tensor (a pass over its
    rows of the chunk table), not once per expert view (256 passes a tensor for DeepSeek V3)."""
    from hybridckpt.formats.dcp.chunked import Chunked
    from hybridckpt.jobs.inspect import _pieces

    calls: list[int] = []
    counted = Chunked.stored_pieces

    def counting(self):
        calls.append(id(self))
        return counted(self)

    monkeypatch.setattr(Chunked, "stored_pieces", counting)
    info = jobs.inspect(_step(root))
    assert len(calls) == len(set(calls))  # each stored tensor's chunks counted once
    src = dcp.open(_step(root))
    stored = {id(t) for t in _chunked_under(src)}
    assert len(calls) == len(stored) < len(info["tensors"])
    monkeypatch.setattr(Chunked, "stored_pieces", counted)
    want = {k: _pieces(t) for k, t in src.tensors.items()}  # counted alone, tensor by tensor
    assert {t["name"]: t["pieces"] for t in info["tensors"]} == want
    md = read_metadata(_step(root))
    rows = md.tensors[W1]
    experts = [f"layers.0.moe.experts.{e}.w1.weight" for e in range(EXPERTS)]  # W1's views
    assert {want[k] for k in experts} == {rows.count} and rows.count > 1


def _chunked_under(src):
    from hybridckpt.formats.dcp.chunked import Chunked

    out, todo, seen = [], list(src.tensors.values()), set()
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, Chunked):
            out.append(t)
            continue
        todo += [getattr(t, a) for a in ("src", "stored", "flat") if isinstance(getattr(t, a, None), lazy.LazyTensor)]
        todo += list(getattr(t, "parts", ()) or ())
    return out
