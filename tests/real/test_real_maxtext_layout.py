"""MaxText's layout and mapping without MaxText (tests/real/test_real_maxtext.py has MaxText's own
files): the value ops and their slot rules, the layer axis both ways, the unscanned names, and the
refusals (a Qwen3 with q/k/v biases, an optimizer export without moments, hostile names)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from cases import case_dir, ckpt

from hybridckpt import jobs, lazy, models
from hybridckpt.containers.orbax.reader import item_arrays
from hybridckpt.errors import ConfigError, FormatError, MappingError
from hybridckpt.formats.maxtext import layout as maxtext
from hybridckpt.rules import Op, parse_rules

RNG = np.random.default_rng(0)


def test_scale_ops_are_maxtexts_float32_arithmetic_and_invert():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    r = parse_rules("a -> b : scale_rsqrt(8)")
    got = r.apply({"a": lazy.as_lazy(x)}).tensors["b"].materialize()
    # MaxText's scale_query_layer: x.astype(f32) * f32(1 / sqrt(head_dim)), cast back
    assert np.array_equal(got, (x * np.float32(1 / np.sqrt(8))).astype(np.float32))
    back = r.invert().apply({"b": lazy.as_lazy(got)}).tensors["a"].materialize()
    assert np.array_equal(back, (got * np.float32(math.sqrt(8))).astype(np.float32))
    np.testing.assert_allclose(back, x, rtol=2e-7)
    bf = lazy.cast(lazy.as_lazy(x), "bfloat16")  # the dtype is kept
    assert np.dtype(Op("scale_rsqrt", (8,)).apply([bf], "t")[0].dtype) == np.dtype(bf.dtype)


def test_a_rescaled_param_rescales_its_moments():
    """q' = q / s: mu' = mu * s, nu' = nu * s^2; layout ops as the param's; an unknown slot refused."""
    r = parse_rules("a -> b : transpose, scale_rsqrt(16)")
    assert [str(o) for o in r.for_slot("exp_avg").rules[0].ops] == ["transpose", "scale_sqrt(16)"]
    assert [str(o) for o in r.for_slot("exp_avg_sq").rules[0].ops] == ["transpose", "scale_mul(16)"]
    assert [str(o) for o in r.invert().for_slot("exp_avg_sq").rules[0].ops] == ["scale_div(16)", "transpose"]
    with pytest.raises(MappingError, match="no rule for optimizer slot 'master'"):
        r.for_slot("master")
    plain = parse_rules("a -> b : transpose")
    assert plain.for_slot("master").rules == plain.rules


def test_layer_axis_to_disk_and_back():
    t = lazy.as_lazy(RNG.standard_normal((3, 5, 2, 4)).astype(np.float32))  # [layers, embed, heads, hd]
    flat = {"decoder.layers.self_attention.query.kernel": t, "token_embedder.embedding": lazy.as_lazy(np.ones((7, 5)))}
    disk = maxtext.to_disk(flat)
    assert disk["decoder.layers.self_attention.query.kernel"].shape == (5, 3, 2, 4)  # param_scan_axis 1
    back = maxtext.from_disk(disk, "x")
    assert np.array_equal(back["decoder.layers.self_attention.query.kernel"].materialize(), t.materialize())
    unscanned = maxtext.to_disk(flat, scan_layers=False)
    assert sorted(unscanned) == ["decoder.layers_0.self_attention.query.kernel",
                                 "decoder.layers_1.self_attention.query.kernel",
                                 "decoder.layers_2.self_attention.query.kernel", "token_embedder.embedding"]
    read = maxtext.from_disk(unscanned, "x")  # restacked, layers first, the parts as they were
    stacked = read["decoder.layers.self_attention.query.kernel"]
    assert np.array_equal(stacked.materialize(), t.materialize())
    assert lazy.index0(stacked, 2) is unscanned["decoder.layers_2.self_attention.query.kernel"]
    gap = {k: v for k, v in unscanned.items() if "layers_1." not in k}
    with pytest.raises(FormatError, match=r"expected layers 0..1, found \[0, 2\]"):
        maxtext.from_disk(gap, "ckpt")
    odd = dict(unscanned, **{"decoder.layers_1.self_attention.query.kernel": lazy.as_lazy(np.ones((5, 2, 3)))})
    with pytest.raises(FormatError, match="layers differ in shape or dtype"):
        maxtext.from_disk(odd, "ckpt")
    with pytest.raises(FormatError, match="both scanned and unscanned"):
        maxtext.from_disk({**disk, **unscanned}, "ckpt")
    with pytest.raises(FormatError, match="layer axis 1"):
        maxtext.from_disk({"decoder.layers.x.scale": lazy.as_lazy(np.ones(3))}, "ckpt")


def _llama():
    return models.config_from_hf(json.load(open(os.path.join(case_dir("torchtitan_llama3"), "config.json"))))


def test_llama_rules_round_trip_and_rope_choice():
    cfg = _llama()
    assert maxtext.rule_vars(cfg) == {"maxtext_interleaved_rope": True}
    hf = {"model.layers.0.self_attn.q_proj.weight": lazy.as_lazy(RNG.standard_normal((32, 32)).astype(np.float32))}
    inv = maxtext.rules(cfg).invert()
    mt = inv.apply(hf, strict=False).tensors["decoder.layers.self_attention.query.kernel"]
    assert mt.shape == (1, 32, 4, 8)
    w = hf["model.layers.0.self_attn.q_proj.weight"].materialize()
    inter = w.reshape(4, 2, 4, 32).transpose(0, 2, 1, 3).reshape(32, 32)  # MaxText's adjust_rope
    assert np.array_equal(mt.materialize()[0], (inter.T.reshape(32, 4, 8) * np.float32(1 / math.sqrt(8))))
    plain = models.config_from_hf({**json.load(open(os.path.join(case_dir("torchtitan_llama3"), "config.json"))),
                                   "rope_scaling": None})
    assert maxtext.rule_vars(plain) == {"maxtext_interleaved_rope": False}
    assert maxtext.notes(plain) == [] and "8192" in maxtext.notes(cfg)[0]
    assert maxtext.overrides(cfg)["rope_type"] == "llama3.1" and "rope_type" not in maxtext.overrides(plain)


def test_unscanned_export_reads_back(tmp_path):
    out = tmp_path / "mt"
    jobs.export_checkpoint(ckpt("torchtitan_llama3"), out, to="maxtext", config=_llama(), options={"scan_layers": False})
    names = sorted(item_arrays(str(out / "3" / "items")))
    assert "params.params.decoder.layers_1.mlp.wo.kernel" in names and not any("decoder.layers." in n for n in names)
    hf = tmp_path / "hf"
    jobs.export_checkpoint(out, hf, to="hf", config=_llama())
    direct = tmp_path / "direct"
    jobs.export_checkpoint(ckpt("torchtitan_llama3"), direct, to="hf", config=_llama())
    from safetensors.numpy import load_file

    a, b = load_file(str(hf / "model.safetensors")), load_file(str(direct / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        if "q_proj" in k:
            np.testing.assert_allclose(a[k], b[k], rtol=2e-7)
        else:
            assert np.array_equal(a[k], b[k]), k


def test_refusals(tmp_path):
    qwen = models.config_from_hf({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32,
                                  "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "attention_bias": True})
    with pytest.raises(ConfigError, match="no q/k/v biases"):
        maxtext.rules(qwen)
    # --optimizer on a weights-only source: the weights alone, and a note saying so (issue 37)
    s = jobs.export_checkpoint(ckpt("hf_bin_llama_sharded"), tmp_path / "o", to="maxtext", optimizer=True)
    assert any("holds no optimizer state (weights only)" in n for n in s.notes), s.notes
    assert not s.with_optimizer
    assert not maxtext.detect(str(tmp_path))
    (tmp_path / "3" / "items").mkdir(parents=True)
    (tmp_path / "3" / "items" / "_METADATA").write_text("{not json")
    assert not maxtext.detect(str(tmp_path))  # a hostile _METADATA is not a MaxText checkpoint


def _qwen3_moe(**over):
    d = json.load(open(os.path.join(case_dir("torchtitan_qwen3_moe"), "config.json")))
    return models.config_from_hf({**d, **over})


def test_qwen3_moe_overrides_refusals_and_notes():
    """MaxText's qwen3_moe block: every layer MoE (a dense layer refused), routing that always
    renormalizes the top k (norm_topk_prob=false said), dropless, the experts' width as mlp_dim."""
    cfg = _qwen3_moe()
    o = maxtext.overrides(cfg)
    assert o["model_name"] == "qwen3-30b-a3b" and o["decoder_block"] == "qwen3_moe"
    assert (o["num_experts"], o["num_experts_per_tok"], o["base_moe_mlp_dim"], o["base_mlp_dim"]) == (4, 2, 16, 16)
    assert o["norm_topk_prob"] is True and o["capacity_factor"] == -1.0 and o["use_qk_norm"] is True
    assert maxtext.notes(cfg) == []
    assert "norm_topk_prob=false" in maxtext.notes(_qwen3_moe(norm_topk_prob=False))[0]
    for dense in ({"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}):
        with pytest.raises(ConfigError, match=r"mixture of experts in every layer; this model's layers \[0\] are dense"):
            maxtext.rules(_qwen3_moe(**dense))


def test_qwen3_moe_expert_layout():
    """HF's per-expert [out, in] -> MaxText's [layers, experts, in, out] (layers first here), and on
    disk the layer axis at 1: [experts, layers, in, out], as MaxText's converter nests them."""
    cfg = _qwen3_moe()
    w = {f"model.layers.{L}.mlp.experts.{e}.gate_proj.weight": lazy.as_lazy(RNG.standard_normal((16, 32)).astype(np.float32))
         for L in range(2) for e in range(4)}
    got = maxtext.rules(cfg).invert().apply(w, strict=False).tensors["decoder.layers.moe_block.wi_0"]
    disk = maxtext.to_disk({"decoder.layers.moe_block.wi_0": got})["decoder.layers.moe_block.wi_0"].materialize()
    assert disk.shape == (4, 2, 32, 16)
    for L in range(2):
        for e in range(4):
            assert np.array_equal(disk[e, L], w[f"model.layers.{L}.mlp.experts.{e}.gate_proj.weight"].materialize().T)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_qwen3_moe_through_maxtext_to_hf_is_the_torchtitan_source_bit_for_bit(tmp_path, scan_layers):
    """torchtitan Qwen3-MoE -> MaxText (--optimizer) -> HF gives what torchtitan -> HF gives: every
    param and both moments bit for bit (no value op: Qwen3's query is stored as HF's), the step."""
    from hybridckpt.jobs.open import open_checkpoint

    src, config = ckpt("torchtitan_qwen3_moe"), os.path.join(case_dir("torchtitan_qwen3_moe"), "config.json")
    mt = tmp_path / "mt"
    jobs.export_checkpoint(src, mt, to="maxtext", optimizer=True, config=config, options={"scan_layers": scan_layers})
    via, direct = tmp_path / "via", tmp_path / "direct"
    jobs.export_checkpoint(mt, via, to="hf", optimizer=True, config=config)
    jobs.export_checkpoint(src, direct, to="hf", optimizer=True, config=config)
    a, b = open_checkpoint(str(via)).named, open_checkpoint(str(direct)).named
    assert a.step == b.step == 3
    assert sorted(a.params) == sorted(b.params) and any(".mlp.experts.3.down_proj." in k for k in a.params)
    for got, want in [(a.params, b.params)] + [(a.slots[s], b.slots[s]) for s in ("exp_avg", "exp_avg_sq")]:
        assert sorted(got) == sorted(want)
        for k in want:
            x, y = got[k].materialize(), want[k].materialize()
            assert x.dtype == y.dtype and np.array_equal(x, y), k
