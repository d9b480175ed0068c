"""Meta Llama `consolidated.NN.pth` + `params.json`: import to HF names, bit for bit.

Fixtures come from tests/fixtures/meta_writer.py (Meta's interleaved RoPE rows and fairscale
splits, written independently of rules/meta_llama.rules).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from fixtures.meta_writer import meta_llama_reference, to_meta_rows, write_meta
from meshes import fit

from hybridckpt import models
from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.io.byte_source import count_reads
from hybridckpt.lazy import ArrayTensor
from hybridckpt.rules import parse_rules


def to_hf(src):
    return parse_rules(src.hf_rules, src.rule_vars).apply(src.tensors).tensors


def assert_matches(src, ref, dtype=torch.float32):
    hf = to_hf(src)
    assert sorted(hf) == sorted(ref.weights)
    for n, t in hf.items():
        want = torch.from_numpy(ref.weights[n]).to(dtype).float().numpy()
        assert np.array_equal(t.materialize().astype(np.float32), want), n


@pytest.mark.parametrize(
    "mp,generation,vocab_in_params",
    [(1, 2, True), (2, 1, False), (2, 2, False), (4, 2, True), (2, 3, True), (4, 3, True)],
)
def test_import(tmp_path, mp, generation, vocab_in_params):
    kv = 8 if generation == 1 else 2  # Llama 1 has no n_kv_heads
    ref = meta_llama_reference(heads=8, kv_heads=kv, seed=mp + generation)
    write_meta(str(tmp_path), ref, mp=mp, generation=generation, vocab_in_params=vocab_in_params)
    assert detect(str(tmp_path)) == "meta-llama"
    src = open_source(str(tmp_path))
    assert src.format == "meta-llama" and src.topology == {"tp": mp}
    assert src.rule_vars["vocab_parallel"] == (generation >= 3 or mp == 1)
    assert src.config.vocab_size == 128 and src.config.num_kv_heads == kv
    assert src.config.intermediate_size == ref.config["intermediate_size"]
    # Llama 1/2 release files carry a `rope.freqs` buffer, Meta's Llama 3 state dicts do not
    assert "rope.freqs" not in src.tensors
    assert any("rope.freqs" in n for n in src.notes) == (generation < 3)
    assert_matches(src, ref)


def test_rope_rows_are_permuted(tmp_path):
    """Meta's q/k rows differ from HF's; the rules permute them back (per head)."""
    ref = meta_llama_reference(seed=3)
    write_meta(str(tmp_path), ref, mp=2, generation=3)
    src = open_source(str(tmp_path))
    wq = src.tensors["layers.1.attention.wq.weight"].materialize()
    hf_q = ref.weights["model.layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(wq, hf_q)
    assert np.array_equal(wq, to_meta_rows(hf_q, 4))
    assert np.array_equal(to_hf(src)["model.layers.1.self_attn.q_proj.weight"].materialize(), hf_q)


def test_replicated_kv_heads(tmp_path):
    """Llama 3.1 405B style: n_kv_heads < mp, each kv head on consecutive pairs of ranks."""
    ref = meta_llama_reference(heads=8, kv_heads=2, seed=4)
    write_meta(str(tmp_path), ref, mp=4, generation=3, kv_replicas=2)
    src = open_source(str(tmp_path))
    assert src.tensors["layers.0.attention.wk.weight"].shape == (2 * 8, 64)
    assert any("replicated" in n for n in src.notes)
    assert_matches(src, ref)


def test_bf16(tmp_path):
    ref = meta_llama_reference(seed=5)
    write_meta(str(tmp_path), ref, mp=2, generation=2, dtype=torch.bfloat16)
    assert_matches(open_source(str(tmp_path)), ref, torch.bfloat16)


def test_box_in_one_shard_reads_only_that_file(tmp_path):
    write_meta(str(tmp_path), meta_llama_reference(seed=6), mp=2, generation=2)
    src = open_source(str(tmp_path))
    f0, f1 = (os.path.join(str(tmp_path), f"consolidated.{i:02d}.pth") for i in (0, 1))
    emb = src.tensors["tok_embeddings.weight"]  # Llama 2: dim 1 split, columns 32.. on rank 1
    with count_reads() as c:
        box = emb.read(np.s_[5:9, 40:50])
    assert c[f1] == box.nbytes and c[f0] == 0
    q = to_hf(src)["model.layers.0.self_attn.q_proj.weight"]  # rows of head 3 live on rank 1
    with count_reads() as c:
        rows = q.read(np.s_[48:64])
    assert c[f1] == rows.nbytes and c[f0] == 0


def test_missing_shard(tmp_path):
    write_meta(str(tmp_path), meta_llama_reference(), mp=4, generation=3)
    os.remove(os.path.join(str(tmp_path), "consolidated.02.pth"))
    with pytest.raises(FormatError, match=r"consolidated\.02\.pth is missing"):
        open_source(str(tmp_path))


def test_mismatched_shard(tmp_path):
    write_meta(str(tmp_path), meta_llama_reference(), mp=2, generation=3)
    f = os.path.join(str(tmp_path), "consolidated.01.pth")
    sd = torch.load(f)
    sd["layers.1.feed_forward.w2.weight"] = sd["layers.1.feed_forward.w2.weight"][:, :-2].clone()
    torch.save(sd, f)
    with pytest.raises(
        FormatError,
        match=r"consolidated\.01\.pth: key 'layers\.1\.feed_forward\.w2\.weight' has shape \(64, 94\)",
    ):
        open_source(str(tmp_path))


def test_vocab_disagreement(tmp_path):
    ref = meta_llama_reference()
    write_meta(str(tmp_path), ref, mp=2, generation=2)
    p = os.path.join(str(tmp_path), "params.json")
    params = json.load(open(p))
    with pytest.raises(ConfigError, match="vocab_size 100"):
        open_source(str(tmp_path), config=models.config_from_hf({**ref.config, "vocab_size": 100}))
    params["vocab_size"] = 99
    json.dump(params, open(p, "w"))
    with pytest.raises(
        FormatError, match=r"params\.json: vocab_size 99 but tok_embeddings holds 128 rows"
    ):
        open_source(str(tmp_path))


def test_logits(tmp_path):
    from hybridckpt.naming import model_rules, nest

    ref = meta_llama_reference(seed=7)
    write_meta(str(tmp_path), ref, mp=2, generation=2)
    src = open_source(str(tmp_path))
    cfg = src.config

    def params(hf):
        flat = (
            model_rules(cfg).apply({k: ArrayTensor(np.asarray(v)) for k, v in hf.items()}).tensors
        )
        return nest({k: t.materialize() for k, t in flat.items()})

    hf = {n: t.materialize() for n, t in to_hf(src).items()}
    tokens = np.random.default_rng(0).integers(0, 128, (2, 11)).astype(np.int32)
    want = np.asarray(models.forward(cfg, params(ref.weights), tokens))
    got = np.asarray(models.forward(cfg, params(hf), tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_import_restore_export_bitwise(tmp_path):
    """consolidated.NN.pth -> Orbax on one mesh -> restore on another -> export: the reference."""
    from e2e import assert_same, roundtrip

    ref = meta_llama_reference(seed=31)
    src = str(tmp_path / "meta")
    write_meta(src, ref, mp=2, generation=3)
    params, _, _, _ = roundtrip(src, str(tmp_path), mesh_a="fsdp=2,tp=2,pp=2", mesh_b="tp=4", optimizer=False)
    assert_same(params, ref.weights)


def test_logits_equal_transformers_after_hfs_own_permute(tmp_path):
    """The imported model's logits equal transformers' LlamaForCausalLM built from the unsplit
    Meta weights after HF's own permute (convert_llama_weights_to_hf.py: `permute`)."""
    import transformers

    from hybridckpt import jobs

    ref = meta_llama_reference(seed=9, heads=4, kv_heads=2)
    write_meta(str(tmp_path), ref, mp=2, generation=3)
    heads, kv = ref.config["num_attention_heads"], ref.config["num_key_value_heads"]

    def hf_permute(w, n_heads):  # transformers' own code, on the unsplit Meta rows
        t = torch.from_numpy(w)
        dim1, dim2 = t.shape
        return t.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    state = {}
    for n, w in ref.weights.items():
        if n.endswith("q_proj.weight"):
            meta_rows = to_meta_rows(w, heads)
            assert not np.array_equal(meta_rows, w)
            state[n] = hf_permute(meta_rows, heads)
        elif n.endswith("k_proj.weight"):
            state[n] = hf_permute(to_meta_rows(w, kv), kv)
        else:
            state[n] = torch.from_numpy(w)
    cfg = transformers.LlamaConfig(**{k: v for k, v in ref.config.items() if k not in ("architectures", "multiple_of")})
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict(state, strict=True)
    tokens = np.random.default_rng(1).integers(0, ref.config["vocab_size"], (2, 10)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path), tokens, mesh=fit("fsdp=2,tp=2"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
