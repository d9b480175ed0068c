"""Megatron-Core distributed checkpoints (torch_dist): import to HF names, bit for bit, with the
distributed optimizer's state in each of its layouts.

Fixtures are written by tests/fixtures/megatron_dist_writer.py with torch's own DCP writer,
following megatron-core's `sharded_state_dict` keys, offsets and chunking (cited there); every
check compares values with the HF reference they were split from.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from fixtures.megatron_dist_writer import trained_llama, write_torch_dist
from fixtures.megatron_writer import make_llama, padded_vocab_size
from meshes import fit

from hybridckpt import models
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.megatron_dist import buckets
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.io.byte_source import count_reads
from hybridckpt.rules import parse_rules

LLAMA = dict(hidden=64, layers=4, heads=8, kv_heads=4, ffn=96, vocab=100)  # GQA, tp up to 4
ODD = dict(hidden=48, layers=4, heads=4, kv_heads=2, ffn=72, vocab=100, head_dim=12)  # not x64
FORMATS = ["dp_reshardable", "fully_reshardable", "fully_sharded_model_space"]


def to_hf(src, tensors):
    return parse_rules(src.hf_rules, src.rule_vars).apply(tensors).tensors


def assert_matches(src, ref, dtype=torch.float32, *, moments=True):
    hf = to_hf(src, src.tensors)
    assert sorted(hf) == sorted(ref.weights)
    for n, t in hf.items():
        want = torch.from_numpy(ref.weights[n]).to(dtype).float().numpy()
        assert np.array_equal(t.materialize().astype(np.float32), want), n
    if not moments:
        return
    opt = src.optimizer
    for kind in ("exp_avg", "exp_avg_sq"):
        mapped = to_hf(src, opt.slots[kind])
        assert sorted(mapped) == sorted(ref.weights), kind
        for n, t in mapped.items():
            assert np.array_equal(t.materialize(), getattr(ref, kind)[n]), (kind, n)
    for n, t in to_hf(src, opt.master).items():  # the fp32 masters are the reference itself
        assert np.array_equal(t.materialize(), ref.weights[n]), ("master", n)


# -- detection, common state, config -----------------------------------------------------------------


@pytest.mark.parametrize("optim", FORMATS)
@pytest.mark.parametrize("common", ["object", "file"])
def test_llama_tp2_pp2(tmp_path, optim, common):
    ref = make_llama(**LLAMA, seed=1)
    it_dir = write_torch_dist(
        str(tmp_path), ref, tp=2, pp=2, optim=optim, common=common, iteration=77
    )
    assert detect(str(tmp_path)) == detect(it_dir) == "megatron-dist"  # not "dcp"
    assert os.path.isfile(os.path.join(it_dir, "common.pt")) == (common == "file")
    src = open_source(str(tmp_path))
    assert src.format == "megatron-dist" and src.step == 77 and src.optimizer.step == 77
    assert src.topology == {"tp": 2, "pp": 2, "vpp": 1, "dp": 2, "files": 8}
    assert src.config == models.config_from_hf(ref.config)
    assert src.tensors["embedding.word_embeddings.weight"].shape == (padded_vocab_size(100, 2), 64)
    assert src.optimizer.hyper["betas"] == [0.9, 0.95]
    assert src.trainer["iteration"] == 77 and src.trainer["checkpoint_version"] == 3.0
    assert any(optim in n for n in src.notes)
    assert_matches(src, ref)


@pytest.mark.parametrize("optim", FORMATS)
@pytest.mark.parametrize(
    "ref_opts,opts",
    [
        (dict(ODD, tied=True), dict(tp=2, pp=2)),  # 64-element padding; the shared embedding bucket
        (LLAMA, dict(tp=2, pp=2, vpp=2)),  # two grad buffers per domain
        (ODD, dict(tp=1, pp=1, dp=4, bucket_size=3000)),  # several buckets
        (LLAMA, dict(tp=4, pp=1, stacked=False, prefix="module.")),  # per-layer keys, NeMo prefix
        (ODD, dict(tp=2, pp=2, chained=True, dtype=torch.bfloat16)),  # chained_0., 16-bit weights
    ],
)
def test_layouts(tmp_path, optim, ref_opts, opts):
    ref = make_llama(**ref_opts, seed=2)
    write_torch_dist(str(tmp_path), ref, optim=optim, **opts)
    src = open_source(str(tmp_path))
    assert_matches(src, ref, opts.get("dtype", torch.float32))


def test_stacked_keys_and_layouts_differ_from_hf(tmp_path):
    """One key per layer stack, SwiGLU fc1 global [gate; up], fused qkv per group: the reads are
    not identities, and the stacked key is cut into the per-layer names."""
    ref = make_llama(**LLAMA, seed=3)
    it_dir = write_torch_dist(str(tmp_path), ref, tp=2, pp=2, optim="none")
    md = read_metadata(it_dir)
    assert md.tensors["decoder.layers.mlp.linear_fc1.weight"].shape == (4, 192, 64)
    assert not any(k.startswith("decoder.layers.0.") for k in md.tensors)
    src = open_source(it_dir)
    assert src.optimizer is None
    p = "model.layers.1."
    fc1 = src.tensors["decoder.layers.1.mlp.linear_fc1.weight"].materialize()
    gate_up = np.concatenate(
        [ref.weights[p + "mlp.gate_proj.weight"], ref.weights[p + "mlp.up_proj.weight"]]
    )
    assert np.array_equal(fc1, gate_up)
    qkv = src.tensors["decoder.layers.1.self_attention.linear_qkv.weight"].materialize()
    plain = np.concatenate([ref.weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert qkv.shape == plain.shape and not np.array_equal(qkv, plain)
    assert_matches(src, ref, moments=False)


def test_vocab_from_config(tmp_path):
    ref = make_llama(**LLAMA, seed=4)
    write_torch_dist(str(tmp_path), ref, tp=2, pp=1, vocab_in_args=False)
    with pytest.raises(FormatError, match=r"common_state.*args\.vocab_size is not set"):
        open_source(str(tmp_path))
    src = open_source(str(tmp_path), config=models.config_from_hf(ref.config))
    assert_matches(src, ref)
    wrong = models.config_from_hf({**ref.config, "intermediate_size": 64})
    with pytest.raises(ConfigError, match="intermediate_size"):
        open_source(str(tmp_path), config=wrong)


@pytest.mark.parametrize(
    "layout, optim, source",
    [
        ("bridge", "dp_reshardable", "run_config.yaml"),
        ("nemo2", "fully_sharded_model_space", "model.yaml"),
        ("nemo2", "dp_reshardable", "model.yaml"),
    ],
)
def test_bridge_and_nemo2_folders(tmp_path, layout, optim, source):
    """No `args`: the config from Bridge's run_config.yaml or NeMo's context/model.yaml, the
    degrees from the buckets and the embedding's chunks; NeMo's `module.` keys."""
    ref = make_llama(**LLAMA, seed=11)
    folder = write_torch_dist(
        str(tmp_path), ref, tp=2, pp=2, optim=optim, layout=layout, iteration=55
    )
    assert os.path.basename(folder) == ("weights" if layout == "nemo2" else "iter_0000055")
    assert detect(str(tmp_path)) == "megatron-dist"
    src = open_source(str(tmp_path))
    assert src.config == models.config_from_hf(ref.config)
    assert src.step == 55 and src.optimizer.step == 55
    assert (src.topology["tp"], src.topology["pp"]) == (2, 2)
    assert f"model config from {source}" in src.notes
    assert_matches(src, ref)


def test_no_args_and_no_yaml_needs_config(tmp_path):
    ref = make_llama(**LLAMA, seed=12)
    it_dir = write_torch_dist(str(tmp_path), ref, tp=2, pp=2, layout="bridge")
    os.remove(os.path.join(it_dir, "run_config.yaml"))
    with pytest.raises(ConfigError, match=r"no 'args' .* pass --config"):
        open_source(str(tmp_path))
    src = open_source(str(tmp_path), config=models.config_from_hf(ref.config))
    assert "model config from the given config" in src.notes
    assert_matches(src, ref)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_is_still_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    assert detect(str(tmp_path / "plain")) == "dcp"


# -- reads are lazy -------------------------------------------------------------------------------------


def test_a_box_reads_only_the_chunks_it_overlaps(tmp_path):
    it_dir = write_torch_dist(str(tmp_path), make_llama(**LLAMA, seed=5), tp=2, pp=2, optim="none")
    md = read_metadata(it_dir)
    chunks = {
        c.offsets: c for c in md.tensors["decoder.layers.self_attention.linear_qkv.weight"].chunks
    }
    src = open_source(it_dir)
    qkv = src.tensors[
        "decoder.layers.3.self_attention.linear_qkv.weight"
    ]  # [128, 64], tp cut at 64
    with count_reads() as c:
        rows = qkv.read(np.s_[70:90])
    read = {f: n for f, n in c.items() if isinstance(f, str) and n}
    mine = chunks[(3, 64, 0)]  # layer 3, tensor-parallel rank 1
    assert list(read) == [mine.path]
    assert rows.nbytes <= read[mine.path] < mine.length  # the box and the archive's directory


# -- optimizer: the bucket walk ------------------------------------------------------------------------


def test_bucket_walk():
    # reverse order: c at 0, b padded to 64, a padded to 128; the bucket ends at a's end
    assert buckets.place([10, 5, 64], [138]) == [(0, 128), (0, 64), (0, 0)]
    assert buckets.place([10, 5, 64], [79], pad=False) == [(0, 69), (0, 64), (0, 0)]
    # a shared param closes the bucket at its padded start, and has one of its own
    assert buckets.place([100, 5, 64], [128, 100]) == [(1, 0), (0, 64), (0, 0)]
    with pytest.raises(FormatError, match=r"bucket sizes \[130\] do not add up"):
        buckets.place([10, 5, 64], [130], "x")


# -- the whole path and the model's outputs ------------------------------------------------------------


def test_import_restore_export_bitwise(tmp_path):
    from e2e import assert_same, roundtrip

    ref = make_llama(**LLAMA, seed=6)
    write_torch_dist(str(tmp_path / "mdist"), ref, tp=2, pp=2, optim="dp_reshardable", iteration=33)
    params, mu, nu, step = roundtrip(
        str(tmp_path / "mdist"), str(tmp_path), mesh_a="fsdp=2,tp=2,pp=2", mesh_b="dp=2,tp=4"
    )
    assert_same(params, ref.weights)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == 33


def test_logits_and_next_step_equal_torch(tmp_path):
    """tp2 pp2 torch_dist of a torch-trained Llama: logits equal transformers' forward of the
    unsplit model; one optax AdamW step from the imported state equals torch's next step."""
    import transformers
    from fixtures.ckpt_checks import optax_next

    from hybridckpt import jobs

    ref, grads, after = trained_llama(steps=3)
    write_torch_dist(str(tmp_path), ref, tp=2, pp=2, optim="dp_reshardable", iteration=3)
    cfg = transformers.LlamaConfig(**{k: v for k, v in ref.config.items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.weights.items()})
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path), tokens, mesh=fit("fsdp=2,pp=2"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    src = open_source(str(tmp_path))
    assert src.optimizer.step == 3
    hf_opt = type(src.optimizer)(
        slots={k: to_hf(src, v) for k, v in src.optimizer.slots.items()},
        step=3,
        hyper=src.optimizer.hyper,
    )
    nxt = optax_next(to_hf(src, src.tensors), hf_opt, grads, src.optimizer.step)
    for k, v in after.items():
        np.testing.assert_allclose(nxt[k], v, rtol=0, atol=1e-6, err_msg=k)


# -- bad input: one-line errors naming file and key ------------------------------------------------------


def test_unfinished_save(tmp_path):
    write_torch_dist(str(tmp_path), make_llama(**LLAMA, seed=7), tp=2, pp=1, finished=False)
    assert detect(str(tmp_path)) == "megatron-dist"
    with pytest.raises(
        FormatError, match=r"iter_0000100: no metadata\.json: an unfinished Megatron save"
    ) as e:
        open_source(str(tmp_path))
    assert "\n" not in str(e.value)


def test_missing_distcp_file(tmp_path):
    it_dir = write_torch_dist(str(tmp_path), make_llama(**LLAMA, seed=8), tp=2, pp=1)
    os.remove(os.path.join(it_dir, "__3_0.distcp"))
    with pytest.raises(FormatError, match=r"__3_0\.distcp: missing; .*\.metadata stores '") as e:
        open_source(str(tmp_path))
    assert "\n" not in str(e.value)


def test_chunks_that_do_not_tile(tmp_path):
    """A chunk dropped from `.metadata` (edited with torch's own classes) leaves a gap."""
    it_dir = write_torch_dist(str(tmp_path), make_llama(**LLAMA, seed=9), tp=2, pp=1, optim="none")
    path = os.path.join(it_dir, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    key = "decoder.layers.self_attention.linear_proj.weight"
    md.state_dict_metadata[key].chunks.pop(1)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(FormatError, match=rf"\.metadata: '{key}' chunks at offsets .* a gap"):
        open_source(str(tmp_path))


def test_uneven_pipeline_leaves_the_buckets_out(tmp_path):
    ref = make_llama(**LLAMA, seed=13)
    overrides = {"decoder_first_pipeline_num_layers": 2}
    write_torch_dist(str(tmp_path), ref, tp=2, pp=2, args_overrides=overrides)
    src = open_source(str(tmp_path))
    assert src.optimizer is None and any("optimizer state NOT read" in n for n in src.notes)
    assert_matches(src, ref, moments=False)


def test_bucket_layout_that_does_not_add_up(tmp_path):
    """args say the head is untied but the buckets hold the tied head's shared copy."""
    ref = make_llama(**LLAMA, tied=True, seed=10)
    write_torch_dist(
        str(tmp_path), ref, tp=2, pp=2, args_overrides={"untie_embeddings_and_output_weights": True}
    )
    with pytest.raises(
        FormatError, match=r"dp_group_idx_2\.gbuf_idx_0 .*bucket sizes .* do not add up"
    ) as e:
        open_source(str(tmp_path))
    assert "\n" not in str(e.value)
