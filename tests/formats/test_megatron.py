"""Megatron-LM legacy checkpoints: import to HF names, bit for bit, with Adam state.

Fixtures are written by tests/fixtures/megatron_writer.py (torch.save, the forward splits
written independently of the .rules files); every check compares values with the reference.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fixtures.megatron_writer import (
    layers_of_chunk,
    make_gpt2,
    make_llama,
    padded_vocab_size,
    write_megatron,
)
from meshes import cases, fit

from hybridckpt import models
from hybridckpt.errors import ConfigError, FormatError, MappingError
from hybridckpt.formats import megatron
from hybridckpt.formats.megatron import optimizer as mo
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.io.byte_source import count_reads
from hybridckpt.lazy import ArrayTensor
from hybridckpt.rules import parse_rules

LLAMA = dict(hidden=64, layers=4, heads=8, kv_heads=4, ffn=96, vocab=100)  # GQA, tp up to 4
GPT2 = dict(hidden=32, layers=2, heads=4, vocab=100)


def to_hf(src, tensors):
    return parse_rules(src.hf_rules, src.rule_vars).apply(tensors).tensors


def as_stored(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """What the reference looks like after being saved in `dtype` (as fp32)."""
    return torch.from_numpy(x).to(dtype).float().numpy()


def assert_matches(src, ref, dtype=torch.float32, *, moments=True):
    hf = to_hf(src, src.tensors)
    assert sorted(hf) == sorted(ref.weights)
    for n, t in hf.items():
        got = t.materialize().astype(np.float32)
        assert np.array_equal(got, as_stored(ref.weights[n], dtype)), n
    if not moments:
        return
    opt = src.optimizer
    assert opt is not None and opt.step == src.step
    for kind in ("exp_avg", "exp_avg_sq"):
        mapped = to_hf(src, opt.slots[kind])
        assert sorted(mapped) == sorted(ref.weights), kind
        for n, t in mapped.items():
            assert t.dtype == np.float32
            assert np.array_equal(t.materialize(), getattr(ref, kind)[n]), (kind, n)
    if dtype != torch.float32:  # 16-bit weights: the fp32 masters are the reference itself
        mapped = to_hf(src, opt.master)
        assert sorted(mapped) == sorted(ref.weights)
        for n, t in mapped.items():
            assert np.array_equal(t.materialize(), ref.weights[n]), ("master", n)


# -- the grid ------------------------------------------------------------------------------------


@pytest.mark.parametrize("keys", ["mcore", "legacy"])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_grid(tmp_path, tp, pp, keys):
    ref = make_llama(**LLAMA, seed=tp * 10 + pp)
    write_megatron(str(tmp_path), ref, tp=tp, pp=pp, keys=keys, iteration=77)
    assert detect(str(tmp_path)) == "megatron"
    src = open_source(str(tmp_path))
    assert src.format == "megatron" and src.step == 77
    assert src.topology == {"tp": tp, "pp": pp, "vpp": 1, "dp": 2}
    assert src.config == models.config_from_hf(ref.config)
    emb = src.tensors["embedding.word_embeddings.weight"]
    assert emb.shape == (padded_vocab_size(100, tp), 64)  # Megatron keeps the padding rows
    assert_matches(src, ref)


@pytest.mark.parametrize(
    "tp,pp,keys,dist",
    [
        (1, 1, "mcore", False),
        (2, 2, "legacy", False),
        (4, 2, "mcore", True),
        (2, 1, "legacy", True),
    ],
)
def test_gpt2(tmp_path, tp, pp, keys, dist):
    ref = make_gpt2(**GPT2, seed=tp + pp)
    write_megatron(str(tmp_path), ref, tp=tp, pp=pp, keys=keys, dist_optim=dist)
    src = open_source(str(tmp_path))
    assert src.config == models.config_from_hf(ref.config)
    assert_matches(src, ref)


@pytest.mark.parametrize("keys", ["mcore", "legacy"])
def test_virtual_pipeline(tmp_path, keys):
    ref = make_llama(**LLAMA, seed=3)
    write_megatron(str(tmp_path), ref, tp=2, pp=2, vpp=2, keys=keys, dist_optim=True)
    src = open_source(str(tmp_path))
    assert src.topology["vpp"] == 2
    # chunk 1 of pp rank 0 holds global layer 2 as its local layer 0
    assert layers_of_chunk(4, 2, 2, 0, 1) == [2]
    assert_matches(src, ref)


@pytest.mark.parametrize("keys,tp,pp", [("mcore", 2, 2), ("legacy", 4, 2), ("mcore", 2, 1)])
def test_tied(tmp_path, keys, tp, pp):
    ref = make_llama(**LLAMA, tied=True, seed=5)
    write_megatron(str(tmp_path), ref, tp=tp, pp=pp, keys=keys)
    src = open_source(str(tmp_path))
    assert src.config.tie_word_embeddings
    assert (
        "output_layer.weight" not in src.tensors
        and "word_embeddings_for_head.weight" not in src.tensors
    )
    if pp > 1:
        assert any("tied head's copy" in n for n in src.notes)
    assert_matches(src, ref)


def test_layouts_differ_from_hf(tmp_path):
    """The merges are not identities: fused qkv, SwiGLU halves, vocab padding all change data."""
    ref = make_llama(**LLAMA, seed=9)
    write_megatron(str(tmp_path), ref, tp=2, pp=1)
    src = open_source(str(tmp_path))
    p = "model.layers.1."
    qkv = src.tensors["decoder.layers.1.self_attention.linear_qkv.weight"].materialize()
    plain = np.concatenate([ref.weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert qkv.shape == plain.shape and not np.array_equal(qkv, plain)
    fc1 = src.tensors["decoder.layers.1.mlp.linear_fc1.weight"]
    shard_concat = np.concatenate([fc1.parts[0].materialize(), fc1.parts[1].materialize()])
    assert not np.array_equal(fc1.materialize(), shard_concat)  # halves, not a plain concat
    gate_up = np.concatenate(
        [ref.weights[p + "mlp.gate_proj.weight"], ref.weights[p + "mlp.up_proj.weight"]]
    )
    assert np.array_equal(fc1.materialize(), gate_up)


# -- optimizer layouts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        dict(coalesced=True, pad64=True),  # core >= r0.8
        dict(coalesced=True, pad64=False),  # core r0.7
        dict(coalesced=False),  # per-bucket lists (core <= r0.6)
        dict(coalesced=True, pad64=True, bucket_size=5000),  # several buckets
    ],
)
def test_distributed_optimizer(tmp_path, opts):
    ref = make_llama(**LLAMA, tied=True, seed=11)
    write_megatron(str(tmp_path), ref, tp=2, pp=2, dist_optim=True, dtype=torch.bfloat16, **opts)
    src = open_source(str(tmp_path))
    assert src.tensors["embedding.word_embeddings.weight"].dtype != np.float32
    assert_matches(src, ref, torch.bfloat16)


def test_pad64_changes_the_layout():
    """The 64-element start padding only shows with sizes that are not multiples of 64."""
    specs = [mo.ParamSpec("a", (3, 7)), mo.ParamSpec("b.bias", (5,)), mo.ParamSpec("c", (64,))]
    with_pad = mo.buffer_layout(specs, pad64=True, bucket_size=None)
    without = mo.buffer_layout(specs, pad64=False, bucket_size=None)
    assert without.offsets == (69, 64, 0) and without.total == 90
    assert with_pad.offsets == (128, 64, 0) and with_pad.total == 149


def test_distributed_optimizer_mismatch(tmp_path):
    ref = make_llama(**LLAMA, seed=12)
    write_megatron(str(tmp_path), ref, tp=1, pp=1, dist_optim=True)
    f = os.path.join(str(tmp_path), "iter_0000120", "mp_rank_00", "distrib_optim.pt")
    state = torch.load(f, weights_only=False)
    (entry,) = state[0].values()
    for k in ("param", "exp_avg", "exp_avg_sq"):
        entry[k] = entry[k][:-3]
    entry["numel_unpadded"] -= 3
    torch.save(state, f)
    with pytest.raises(FormatError, match=r"distrib_optim\.pt: grad buffer 0: numel_unpadded"):
        open_source(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_adam_state(tmp_path, dtype):
    ref = make_gpt2(**GPT2, seed=13)
    write_megatron(str(tmp_path), ref, tp=2, pp=2, dtype=dtype, iteration=42)
    src = open_source(str(tmp_path))
    assert src.optimizer.step == 42
    assert src.optimizer.hyper["betas"] == [0.9, 0.95] and src.optimizer.hyper["eps"] == 1e-8
    assert bool(src.optimizer.master) == (dtype != torch.float32)
    assert src.trainer["consumed_train_samples"] == 42 * 8
    assert src.trainer["opt_param_scheduler"]["lr_decay_style"] == "cosine"
    assert_matches(src, ref, dtype)


def test_no_optimizer(tmp_path):
    ref = make_llama(**LLAMA, seed=14)
    write_megatron(str(tmp_path), ref, tp=2, pp=1, optim=False)
    src = open_source(str(tmp_path))
    assert src.optimizer is None
    assert_matches(src, ref, moments=False)


# -- versions, folders, vocab ---------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1.0])
def test_old_qkv_versions(tmp_path, version):
    ref = make_gpt2(**GPT2, seed=15)
    write_megatron(
        str(tmp_path),
        ref,
        tp=2,
        pp=1,
        keys="legacy_old",
        checkpoint_version=version,
        dist_optim=True,
        coalesced=False,
    )
    raw = torch.load(
        os.path.join(str(tmp_path), "iter_0000120", "mp_rank_00", "model_optim_rng.pt"),
        weights_only=False,
    )
    stored = raw["model"]["language_model"]["transformer"][
        "layers.0.attention.query_key_value.weight"
    ]
    src = open_source(str(tmp_path))
    fixed = src.tensors["decoder.layers.0.self_attention.linear_qkv.weight"].materialize()[
        : stored.shape[0]
    ]
    assert not np.array_equal(fixed, stored.numpy())  # the per-shard reorder did something
    assert_matches(src, ref)


def test_unconvertible_version(tmp_path):
    write_megatron(
        str(tmp_path), make_gpt2(**GPT2), tp=1, pp=1, keys="legacy", checkpoint_version=1.5
    )
    with pytest.raises(
        FormatError, match=r"mp_rank_00/model_optim_rng\.pt: checkpoint_version 1\.5"
    ):
        open_source(str(tmp_path))


def test_release_and_iteration_folder(tmp_path):
    ref = make_llama(**LLAMA, seed=16)
    write_megatron(str(tmp_path), ref, tp=2, pp=2, release=True)
    assert (
        open_source(str(tmp_path)).tensors.keys()
        == open_source(str(tmp_path / "release")).tensors.keys()
    )
    assert_matches(open_source(str(tmp_path / "release")), ref)


@pytest.mark.parametrize("pad_mode", ["copy", "random"])
def test_vocab_from_config(tmp_path, pad_mode):
    ref = make_llama(**LLAMA, seed=17)
    write_megatron(str(tmp_path), ref, tp=2, pp=1, vocab_in_args=False, pad_mode=pad_mode)
    with pytest.raises(
        FormatError, match=r"model_optim_rng\.pt: args\.vocab_size is not set.*--config"
    ):
        open_source(str(tmp_path))
    cfg = models.config_from_hf(ref.config)
    src = open_source(str(tmp_path), config=cfg)
    padded = src.tensors["embedding.word_embeddings.weight"].materialize()[100:]
    assert padded.shape[0] == 156 and np.all(padded != 0)  # padding rows are never zeros
    assert_matches(src, ref)
    wrong = models.config_from_hf({**ref.config, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="num_layers"):
        open_source(str(tmp_path), config=wrong)


# -- bad input ---------------------------------------------------------------------------------------


def _rank_file(root, name):
    return os.path.join(str(root), "iter_0000120", name, "model_optim_rng.pt")


def test_missing_rank_folder(tmp_path):
    write_megatron(str(tmp_path), make_llama(**LLAMA), tp=2, pp=2)
    d = os.path.join(str(tmp_path), "iter_0000120", "mp_rank_01_001")
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    os.rmdir(d)
    with pytest.raises(FormatError, match=r"mp_rank_01_001 is missing"):
        open_source(str(tmp_path))


def test_rank_with_mismatched_shape(tmp_path):
    write_megatron(str(tmp_path), make_llama(**LLAMA), tp=2, pp=1)
    f = _rank_file(tmp_path, "mp_rank_01")
    st = torch.load(f, weights_only=False)
    key = "decoder.layers.2.self_attention.linear_proj.weight"
    st["model"][key] = st["model"][key][:, :-1].clone()
    torch.save(st, f)
    with pytest.raises(
        FormatError,
        match=r"mp_rank_01/model_optim_rng\.pt: key 'decoder\.layers\.2\.self_attention\.linear_proj\.weight' has shape \(64, 31\), expected \(64, 32\)",
    ):
        open_source(str(tmp_path))


def test_unknown_key_is_listed(tmp_path):
    write_megatron(str(tmp_path), make_llama(**LLAMA), tp=1, pp=1, optim=False)
    f = _rank_file(tmp_path, "mp_rank_00")
    st = torch.load(f, weights_only=False)
    st["model"]["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(8)
    torch.save(st, f)
    src = open_source(str(tmp_path))
    with pytest.raises(
        MappingError, match=r"decoder\.layers\.0\.self_attention\.q_layernorm\.weight"
    ):
        parse_rules(src.hf_rules, src.rule_vars).apply(src.tensors)


def test_head_copy_must_match(tmp_path):
    write_megatron(str(tmp_path), make_llama(**LLAMA, tied=True), tp=1, pp=2, keys="legacy")
    f = _rank_file(tmp_path, "mp_rank_00_001")
    st = torch.load(f, weights_only=False)
    st["model"]["word_embeddings_for_head"]["weight"][0, 0] += 1
    torch.save(st, f)
    with pytest.raises(FormatError, match=r"word_embeddings_for_head\.weight row 0 differs"):
        open_source(str(tmp_path))


def test_not_llama_or_gpt2(tmp_path):
    write_megatron(str(tmp_path), make_llama(**LLAMA), tp=1, pp=1)
    f = _rank_file(tmp_path, "mp_rank_00")
    st = torch.load(f, weights_only=False)
    st["args"].normalization = "LayerNorm"
    torch.save(st, f)
    with pytest.raises(
        FormatError, match=r"model_optim_rng\.pt: args describe normalization=LayerNorm"
    ):
        open_source(str(tmp_path))


# -- reads and logits ----------------------------------------------------------------------------------


def test_box_in_one_shard_reads_only_that_file(tmp_path):
    write_megatron(str(tmp_path), make_llama(**LLAMA, seed=21), tp=2, pp=1)
    src = open_source(str(tmp_path))
    f0, f1 = _rank_file(tmp_path, "mp_rank_00"), _rank_file(tmp_path, "mp_rank_01")
    emb = src.tensors["embedding.word_embeddings.weight"]  # concat(0): rows 128.. are on rank 1
    with count_reads() as c:
        rows = emb.read(np.s_[130:140])
    assert c[f1] == rows.nbytes and c[f0] == 0
    proj = src.tensors["decoder.layers.3.self_attention.linear_proj.weight"]  # concat(1)
    with count_reads() as c:
        cols = proj.read(np.s_[:, 2:20])
    assert c[f0] == cols.nbytes and c[f1] == 0
    with count_reads() as c:
        whole = emb.read()
    assert c[f0] + c[f1] == whole.nbytes


def _flax_params(cfg, hf: dict):
    from hybridckpt.naming import model_rules, nest

    flat = model_rules(cfg).apply({k: ArrayTensor(np.asarray(v)) for k, v in hf.items()}).tensors
    return nest({k: t.materialize() for k, t in flat.items()})


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_logits(tmp_path, family):
    ref = make_llama(**LLAMA, seed=31) if family == "llama" else make_gpt2(**GPT2, seed=31)
    write_megatron(str(tmp_path), ref, tp=2, pp=2, keys="mcore" if family == "llama" else "legacy")
    src = open_source(str(tmp_path))
    hf = {n: t.materialize() for n, t in to_hf(src, src.tensors).items()}
    cfg = src.config
    tokens = np.random.default_rng(0).integers(0, 100, (2, 9)).astype(np.int32)
    want = np.asarray(models.forward(cfg, _flax_params(cfg, ref.weights), tokens))
    got = np.asarray(models.forward(cfg, _flax_params(cfg, hf), tokens))
    assert want.shape == (2, 9, 100)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_torch_dist_folder_is_not_claimed(tmp_path):
    """Megatron's torch_dist format has the tracker too, but DCP files instead of mp_rank_*."""
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    it = tmp_path / "iter_0000010"
    it.mkdir()
    (it / "__0_0.distcp").write_bytes(b"\0" * 16)
    (it / "metadata.json").write_text("{}")
    assert not megatron.detect(str(tmp_path))
    write_megatron(str(tmp_path / "m"), make_gpt2(**GPT2), tp=1, pp=1)
    assert megatron.detect(str(tmp_path / "m"))
    assert megatron.detect(str(tmp_path / "m" / "iter_0000120"))


# -- the whole path: import -> Orbax -> restore on another mesh -> export ---------------------------


@pytest.mark.parametrize(
    "family,opts,mesh_a,mesh_b",
    cases([
        ("llama", dict(tp=2, pp=2, vpp=2, dist_optim=True, dtype=torch.bfloat16), "fsdp=2,tp=2,pp=2", "dp=2,tp=4"),
        ("llama", dict(tp=4, pp=1, keys="legacy"), "tp=4,pp=2", "fsdp=8"),
        ("gpt2", dict(tp=2, pp=2, dist_optim=True), "pp=2,tp=4", "dp=1"),
    ]),
)
def test_import_restore_export_bitwise(tmp_path, family, opts, mesh_a, mesh_b):
    from e2e import assert_same, roundtrip

    ref = make_llama(**LLAMA, seed=21) if family == "llama" else make_gpt2(**GPT2, seed=22)
    src = str(tmp_path / "megatron")
    write_megatron(src, ref, iteration=33, **opts)
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    # with 16-bit weights the fp32 master weights are what gets imported: the reference itself
    assert_same(params, ref.weights)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == 33


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_logits_equal_transformers_on_the_reference(tmp_path, family):
    """Megatron tp2 pp2 -> our model's logits equal transformers' forward on the unsplit reference."""
    import transformers

    from hybridckpt import jobs

    ref = make_llama(**LLAMA, seed=32) if family == "llama" else make_gpt2(**GPT2, seed=32)
    write_megatron(str(tmp_path), ref, tp=2, pp=2, keys="mcore" if family == "llama" else "legacy")
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in ref.config.items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.GPT2LMHeadModel
    model = cls(cfg).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.weights.items()}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing)  # GPT-2's head is tied
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path), tokens, mesh=fit("fsdp=2,pp=2"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
