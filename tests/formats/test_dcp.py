"""torch DCP checkpoints (FSDP2, FSDP2 x TP, rank-local metadata, safetensors shards, torchtitan
names): import bit for bit, one optax step equals torch's AdamW step, bad input is refused.

Fixtures are written once per session by the real torch (tests/fixtures/dcp_writer.py: 4 gloo
processes); references are what torch itself gathered (full state dicts), not our reader.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
from fixtures import FIXTURES
from fixtures.ckpt_checks import (
    assert_export_equals,
    export_in_fresh_process,
    optax_next,
    run_writer,
)
from fixtures.torch_common import load_reference, reference_names
from meshes import cases, fit

from hybridckpt import naming
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.errors import FormatError
from hybridckpt.formats import dcp
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.io.byte_source import close_all, count_reads

WRITER = os.path.join(FIXTURES, "dcp_writer.py")
EMBED = "model.model.embed_tokens.weight"


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    run_writer(WRITER, out)
    return out


def assert_exact(src, ref):
    assert sorted(src.tensors) == reference_names(ref, "param")
    for k, t in src.tensors.items():
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k
    opt = src.optimizer
    for kind in ("exp_avg", "exp_avg_sq"):
        got = opt.slots[kind]
        assert sorted(got) == reference_names(ref, kind)
        for k, t in got.items():
            assert t.dtype == np.float32
            assert np.array_equal(t.materialize(), ref[f"{kind}/{k}"]), (kind, k)


# -- the fixtures are what they claim ----------------------------------------------------------


def test_fixture_layouts_are_the_hard_ones(root):
    fsdp = read_metadata(os.path.join(root, "fsdp2"))
    rows = sorted((c.offsets[0], c.sizes[0]) for c in fsdp.tensors[EMBED].chunks)
    assert [n for _, n in rows] == [63, 63, 63, 61]  # vocab 250 over 4 ranks: uneven
    tp = read_metadata(os.path.join(root, "tp"))
    q = tp.tensors["model.model.layers.0.self_attn.q_proj.weight"]
    by_file = sorted(q.chunks, key=lambda c: os.path.basename(c.path))
    offsets = [c.offsets[0] for c in by_file]
    assert offsets != sorted(offsets)  # strided dp x tp: rank order is not row order
    o = tp.tensors["model.model.layers.0.self_attn.o_proj.weight"]
    assert {c.offsets for c in o.chunks} == {(0, 0), (0, 32), (32, 0), (32, 32)}  # 2-D grid
    local = os.listdir(os.path.join(root, "fsdp2_local"))
    assert ".metadata" not in local and "__3.metadata" in local


# -- exact import ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["fsdp2", "tp", "fsdp2_local"])
def test_params_and_moments_exact(root, variant):
    path = os.path.join(root, variant)
    assert detect(path) == "dcp"
    src = open_source(path)
    ref, info = load_reference(root, "tp" if variant == "tp" else "fsdp2")
    assert_exact(src, ref)
    assert src.optimizer.step == src.step == int(info["step"]) == 3
    hyper = info["hyper"]
    assert src.optimizer.hyper == {
        "lr": hyper["lr"],
        "eps": hyper["eps"],
        "weight_decay": hyper["weight_decay"],
        "betas": list(hyper["betas"]),
        # torch AdamW's flags, kept: decoupled decay is what optax.adamw does
        "decoupled_weight_decay": True, "amsgrad": False, "maximize": False,
    }
    assert src.hf_rules == ""
    assert src.config is not None and src.config.vocab_size == 250  # config.json beside it


def test_safetensors_shards(root):
    path = os.path.join(root, "fsdp2_hf")
    assert detect(path) == "dcp"
    assert not any(n.endswith(".metadata") for n in os.listdir(path))
    src = dcp.open(path)
    ref, _ = load_reference(root, "fsdp2")
    assert src.optimizer is None
    assert sorted(src.tensors) == reference_names(ref, "param")
    for k, t in src.tensors.items():
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k


def test_filesystem_writer_safetensors_serialization(tmp_path):
    import torch
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g).bfloat16()}
    writer = tdcp.FileSystemWriter(
        str(tmp_path), serialization_format=SerializationFormat.SAFETENSORS
    )
    tdcp.save({"model": sd}, storage_writer=writer, no_dist=True)
    src = dcp.open(str(tmp_path))
    assert sorted(src.tensors) == ["b", "w"]
    assert np.array_equal(src.tensors["w"].materialize(), sd["w"].numpy())
    got_b = src.tensors["b"].materialize()
    assert str(got_b.dtype) == "bfloat16"
    assert np.array_equal(got_b.astype(np.float32), sd["b"].float().numpy())


def test_sgd_momentum_comes_through_as_its_own_slot(tmp_path):
    """Whatever per-parameter state the optimizer keeps is a slot under torch's name (here SGD's
    `momentum_buffer`), never forced into Adam's two moments."""
    import torch
    import torch.distributed.checkpoint as tdcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    fqn = dict(enumerate(n for n, _ in model.named_parameters()))
    osd = opt.state_dict()  # keyed by fqn, as get_state_dict gives it
    optim_sd = {
        "state": {fqn[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
    tdcp.save({"model": model.state_dict(), "optim": optim_sd}, checkpoint_id=str(tmp_path), no_dist=True)
    src = dcp.open(str(tmp_path))
    assert sorted(src.tensors) == sorted(fqn.values())
    assert list(src.optimizer.slots) == ["momentum_buffer"]
    for name, p in model.named_parameters():
        want = opt.state[p]["momentum_buffer"].numpy()
        assert np.array_equal(src.optimizer.slots["momentum_buffer"][name].materialize(), want)
    assert src.optimizer.hyper["lr"] == 0.1
    assert src.optimizer.optimizer.name == "sgd"  # hybridckpt.optim.for_slots


def test_torchtitan_names_and_rope_permutation(root):
    src = dcp.open(os.path.join(root, "titan"))
    ref, _ = load_reference(root, "fsdp2")
    assert (
        src.trainer["optimizer_prefix"] == "optimizer." and src.trainer["model_prefix"] == "model."
    )
    wq = src.tensors["layers.0.attention.wq.weight"].materialize()
    hf_q = ref["param/model.layers.0.self_attn.q_proj.weight"]
    assert wq.shape == hf_q.shape and not np.array_equal(wq, hf_q)  # rows really are permuted
    assert src.optimizer.step == 3 and src.optimizer.hyper["lr"] == 0.01
    cfg = dcp.open(os.path.join(root, "fsdp2")).config
    hf = naming.source_to_hf(src, cfg)
    assert sorted(hf.params) == reference_names(ref, "param")
    for k, t in hf.params.items():
        assert np.array_equal(t.materialize(), ref[f"param/{k}"]), k
        assert np.array_equal(hf.slots["exp_avg"][k].materialize(), ref[f"exp_avg/{k}"]), k
        assert np.array_equal(hf.slots["exp_avg_sq"][k].materialize(), ref[f"exp_avg_sq/{k}"]), k


# -- one optax step equals torch AdamW's next step --------------------------------------------------


def max_rel_error(got, ref):
    return max(
        float(np.max(np.abs(got[k] - ref[f"next/{k}"])) / np.max(np.abs(ref[f"next/{k}"])))
        for k in got
    )


@pytest.mark.parametrize("variant", ["fsdp2", "tp"])
def test_optax_step_matches_torch_adamw(root, variant):
    src = dcp.open(os.path.join(root, variant))
    ref, _ = load_reference(root, variant)
    grads = {k: ref[f"grad/{k}"] for k in src.tensors}
    moved = max(float(np.max(np.abs(ref[f"next/{k}"] - ref[f"param/{k}"]))) for k in src.tensors)
    assert moved > 1e-3  # the step really changes the params
    new = optax_next(src.tensors, src.optimizer, grads, src.optimizer.step)
    for k, got in new.items():
        want = ref[f"next/{k}"]
        np.testing.assert_allclose(
            got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))), err_msg=k
        )
    # the check can fail: a wrong step count (bias correction) is far outside the tolerance
    wrong = optax_next(src.tensors, src.optimizer, grads, src.optimizer.step - 1)
    assert max_rel_error(wrong, ref) > 1e-3


# -- laziness ----------------------------------------------------------------------------------------


def test_box_reads_only_its_chunk(root):
    md = read_metadata(os.path.join(root, "fsdp2"))
    src = dcp.open(os.path.join(root, "fsdp2"))
    ref, _ = load_reference(root, "fsdp2")
    embed = src.tensors["model.embed_tokens.weight"]
    owner = next(
        c for c in md.tensors[EMBED].chunks if c.offsets[0] <= 70 < c.offsets[0] + c.sizes[0]
    )
    embed.read((slice(0, 1),))  # parse the first chunk's archive (metadata, not tensor bytes)
    embed.read((slice(70, 71),))
    with count_reads() as c:
        got = embed.read((slice(70, 73), slice(8, 24)))
    assert np.array_equal(got, ref["param/model.embed_tokens.weight"][70:73, 8:24])
    data = {k: v for k, v in c.items() if isinstance(k, str)}
    assert data == {owner.path: 3 * 16 * 4}
    # the three row pieces: one copy out of the mapped file, only their bytes
    assert c[(owner.path, "calls")] == 1


def test_moved_checkpoint_reads_the_new_folder(root, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(root, "fsdp2"), moved)
    src = dcp.open(str(moved))
    assert src.trainer["written_to"] == os.path.join(str(root), "fsdp2") != str(moved)
    ref, _ = load_reference(root, "fsdp2")
    with count_reads() as c:
        for k, t in src.tensors.items():
            assert np.array_equal(t.materialize(), ref[f"param/{k}"])
    files = [k for k in c if isinstance(k, str)]
    assert files and all(p.startswith(str(moved)) for p in files)


# -- bad input -------------------------------------------------------------------------------------


def edited_copy(root, tmp_path, edit):
    """A copy of the FSDP2 checkpoint whose .metadata was changed by `edit(Metadata)` (torch)."""
    import torch.distributed.checkpoint  # noqa: F401  (the classes the pickle names)

    path = tmp_path / "edited"
    shutil.copytree(os.path.join(root, "fsdp2"), path)
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own fixture, written by torch in this session
    edit(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return str(path)


def test_overlapping_chunks_are_refused(root, tmp_path):
    import torch

    def overlap(md):
        chunks = md.state_dict_metadata[EMBED].chunks
        i = next(i for i, c in enumerate(chunks) if c.offsets[0] == 63)
        old = chunks[i].offsets
        new = torch.Size([62, 0])
        chunks[i].offsets = new
        for idx in list(md.storage_data):
            if idx.fqn == EMBED and tuple(idx.offset) == tuple(old):
                info = md.storage_data.pop(idx)
                md.storage_data[type(idx)(EMBED, new, idx.index)] = info

    path = edited_copy(root, tmp_path, overlap)
    with pytest.raises(FormatError) as e:
        dcp.open(path)
    msg = str(e.value)
    assert EMBED in msg and "overlap" in msg and "(62, 0)" in msg and ".metadata" in msg


def test_gap_in_chunks_is_refused(root, tmp_path):
    def gap(md):
        chunks = md.state_dict_metadata[EMBED].chunks
        del chunks[[c.offsets[0] for c in chunks].index(126)]

    path = edited_copy(root, tmp_path, gap)
    with pytest.raises(FormatError) as e:
        dcp.open(path)
    msg = str(e.value)
    assert EMBED in msg and "gap" in msg and "(189, 0)" in msg and ".metadata" in msg


def test_missing_distcp_is_refused(root, tmp_path):
    path = tmp_path / "missing"
    shutil.copytree(os.path.join(root, "fsdp2"), path)
    close_all()
    os.remove(path / "__2_0.distcp")
    with pytest.raises(FormatError) as e:
        dcp.open(str(path))
    assert "__2_0.distcp" in str(e.value) and "missing" in str(e.value)


def test_truncated_distcp_is_refused(root, tmp_path):
    path = tmp_path / "truncated"
    shutil.copytree(os.path.join(root, "fsdp2"), path)
    close_all()
    f = path / "__1_0.distcp"
    os.truncate(f, os.path.getsize(f) // 2)
    with pytest.raises(FormatError) as e:
        dcp.open(str(path))
    assert "__1_0.distcp" in str(e.value) and "truncated" in str(e.value)


def test_not_dcp(tmp_path):
    assert not dcp.detect(str(tmp_path))
    with pytest.raises(FormatError):
        dcp.open(str(tmp_path))


# -- the whole path ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,mesh_a,mesh_b", cases([("fsdp2", "fsdp=2,pp=2", "dp=2,fsdp=4"), ("tp", "tp=2,pp=2", "fsdp=8")]))
def test_import_restore_export_and_logits(root, tmp_path, variant, mesh_a, mesh_b):
    """DCP -> Orbax on mesh A -> restore on mesh B -> export: bitwise the torch references; the
    imported model's logits equal transformers' forward on torch's own gathered weights."""
    import torch
    import transformers
    from e2e import assert_same, roundtrip

    from hybridckpt import jobs

    path = os.path.join(root, variant)
    ref, info = load_reference(root, "tp" if variant == "tp" else "fsdp2")
    weights = {k: ref[f"param/{k}"] for k in reference_names(ref, "param")}
    params, mu, nu, step = roundtrip(path, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, weights)
    assert_same(mu, {k: ref[f"exp_avg/{k}"] for k in weights}, "exp_avg")
    assert_same(nu, {k: ref[f"exp_avg_sq/{k}"] for k in weights}, "exp_avg_sq")
    assert step == 3
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    tokens = np.array([[3, 17, 249, 0, 42, 7, 100, 5]], dtype=np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(os.path.join(str(tmp_path), "orbax"), tokens, mesh=mesh_b)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_checkpoint_without_config_imports_generically_or_with_config(root, tmp_path, capsys):
    """No config.json anywhere: inspect says a config is needed for the model; import stores the
    tensors under DCP's own names (generic sharding, restorable anywhere); with --config it
    imports the model, which verifies against the source under HF names."""
    from hybridckpt.cli import main

    bare = tmp_path / "bare"
    shutil.copytree(os.path.join(root, "fsdp2"), bare)
    cfg_file = tmp_path / "llama-config.json"
    shutil.move(str(bare / "config.json"), cfg_file)
    assert main(["inspect", str(bare), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["needs_config"] is True
    assert main(["import", str(bare), str(tmp_path / "x"), "--mesh", fit("fsdp=2,tp=2"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "no model config: tensors imported under the source's own names" in out
    assert main(["inspect", str(tmp_path / "x")]) == 0
    assert "model.layers.0.self_attn.q_proj.weight" in capsys.readouterr().out
    assert main(["verify", str(bare), str(tmp_path / "x"), "--quiet"]) == 0
    assert main(["logits", str(tmp_path / "x"), "--tokens", "1,2"]) == 2
    assert "carries no model config; logits needs one" in capsys.readouterr().err
    assert main(["import", str(bare), str(tmp_path / "y"), "--config", str(cfg_file), "--quiet"]) == 0
    assert main(["verify", str(bare), str(tmp_path / "y"), "--config", str(cfg_file), "--quiet"]) == 0


# -- straight to one file (the job of torch's dcp_to_torch_save) -----------------------------------

@pytest.mark.parametrize("variant", ["fsdp2", "tp"])
def test_export_straight_to_safetensors_copies_stored_bytes_without_jax(root, tmp_path, variant):
    """`hybridckpt export DCP OUT --optimizer`: torch's own gathered tensors bit for bit. Dim-0
    chunks (FSDP2) are copied file to file by the kernel; the tp variant's 2-D grid is read and
    written. Neither the export nor `inspect` and `verify` of the two loads JAX, Flax or Orbax."""
    out = str(tmp_path / "hf")
    probe = export_in_fresh_process(os.path.join(root, variant), out)
    assert probe["loaded"] == [] and probe["equal"]
    ref, _ = load_reference(root, "tp" if variant == "tp" else "fsdp2")
    opt = assert_export_equals(out, ref, reference_names(ref, "param"))
    assert int(opt["step"].materialize()) == 3
    if variant == "fsdp2":
        assert probe["copied"] == probe["bytes"]  # every tensor byte copied, none read
    else:
        assert 0 < probe["copied"] < probe["bytes"]  # row-parallel grids are read instead
