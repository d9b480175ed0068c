"""The mapping language: each op against a numpy reference, inverses exact, errors that name the rule."""

import numpy as np
import pytest

from hybridckpt.errors import MappingError
from hybridckpt.lazy import ArrayTensor
from hybridckpt.rules import Op, load_rules, merge_tp, parse_rules

rng = np.random.default_rng(0)


def arr(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def mat(t):
    return t.materialize()


def roundtrip(rules, src):
    out = rules.apply({k: ArrayTensor(v) for k, v in src.items()})
    back = rules.invert().apply_unstack(out.tensors)
    for k, v in src.items():
        np.testing.assert_array_equal(mat(back.tensors[k]), v)
    return out.tensors


def test_rename_transpose_stack_and_inverse():
    src = {f"m.layers.{i}.w": arr(6, 4) for i in range(3)} | {"m.norm": arr(4)}
    rules = parse_rules("m.layers.$L.w -> layers.kernel[$L] : transpose\nm.norm -> norm.scale")
    out = roundtrip(rules, src)
    want = np.stack([src[f"m.layers.{i}.w"].T for i in range(3)])
    assert not np.array_equal(want.shape, src["m.layers.0.w"].shape)
    np.testing.assert_array_equal(mat(out["layers.kernel"]), want)
    np.testing.assert_array_equal(mat(out["norm.scale"]), src["m.norm"])


def test_fused_qkv_gqa_against_numpy():
    heads, kv, hd, hidden = 8, 2, 3, 5
    group = heads // kv
    w = arr(kv * (group + 2) * hd, hidden)
    blocks = w.reshape(kv, group + 2, hd, hidden)
    q = blocks[:, :group].reshape(-1, hidden)
    k = blocks[:, group].reshape(-1, hidden)
    v = blocks[:, group + 1].reshape(-1, hidden)
    rules = parse_rules("qkv -> q, k, v : fused_qkv(0, {h}, {kv})", {"h": heads, "kv": kv})
    out = roundtrip(rules, {"qkv": w})
    for name, want in (("q", q), ("k", k), ("v", v)):
        np.testing.assert_array_equal(mat(out[name]), want)
    assert not np.array_equal(mat(out["q"]), w[: heads * hd])  # the plain split would be wrong


def test_rope_permute_equals_hf_permute():
    heads, hd, dim = 4, 6, 5
    w = arr(heads * hd, dim)
    # huggingface/transformers convert_llama_weights_to_hf.py: permute()
    hf = w.reshape(heads, hd // 2, 2, dim).transpose(0, 2, 1, 3).reshape(heads * hd, dim)
    rules = parse_rules("wq -> q_proj : rope_permute(4)")
    out = roundtrip(rules, {"wq": w})
    assert not np.array_equal(hf, w)
    np.testing.assert_array_equal(mat(out["q_proj"]), hf)


def test_unflatten_split_trim_and_pad_inverse():
    src = {"c_attn": arr(4, 12), "fc1": arr(10, 3), "emb": arr(7, 2)}
    rules = parse_rules(
        "c_attn -> qkv : unflatten(1, 3, -1)\n"
        "fc1 -> gate, up : split(0, 2)\n"
        "emb -> embed : trim(0, 5, 7)\n"
    )
    out = rules.apply({k: ArrayTensor(v) for k, v in src.items()}).tensors
    np.testing.assert_array_equal(mat(out["qkv"]), src["c_attn"].reshape(4, 3, 4))
    np.testing.assert_array_equal(mat(out["gate"]), src["fc1"][:5])
    np.testing.assert_array_equal(mat(out["up"]), src["fc1"][5:])
    np.testing.assert_array_equal(mat(out["embed"]), src["emb"][:5])
    back = rules.invert().apply(out).tensors
    np.testing.assert_array_equal(mat(back["c_attn"]), src["c_attn"])
    np.testing.assert_array_equal(mat(back["fc1"]), src["fc1"])
    # trim's inverse pads with zeros: the padding rows are not recoverable, the real rows are
    np.testing.assert_array_equal(mat(back["emb"])[:5], src["emb"][:5])
    assert (mat(back["emb"])[5:] == 0).all()


def test_tp_merges():
    shards = [arr(4, 3) for _ in range(2)]
    t = [ArrayTensor(s) for s in shards]
    np.testing.assert_array_equal(mat(merge_tp(t, Op("concat", (1,)))), np.concatenate(shards, 1))
    halves = np.concatenate([shards[0][:2], shards[1][:2], shards[0][2:], shards[1][2:]])
    assert not np.array_equal(halves, np.concatenate(shards))
    np.testing.assert_array_equal(mat(merge_tp(t, Op("halves", (0,)))), halves)
    np.testing.assert_array_equal(mat(merge_tp(t, Op("replicated"))), shards[0])
    rules = parse_rules("tp *.fc1.weight : halves(0) when swiglu\ntp *.fc1.weight : concat(0)", {"swiglu": False})
    assert rules.tp_merge_for("x.fc1.weight").merge == Op("concat", (0,))


def test_when_guards_and_variables():
    text = "a -> b : transpose when tied\na -> c when not tied\n"
    assert "b" in parse_rules(text, {"tied": True}).apply({"a": ArrayTensor(arr(2, 3))}).tensors
    assert "c" in parse_rules(text, {"tied": False}).apply({"a": ArrayTensor(arr(2, 3))}).tensors
    with pytest.raises(MappingError, match="unknown variable"):
        parse_rules("a -> b : split(0, {nope})")


def test_unconsumed_keys_and_unused_rules_are_reported():
    rules = parse_rules("a -> b\nzzz -> y\n", origin="my.rules")
    src = {"a": ArrayTensor(arr(2)), "extra.key": ArrayTensor(arr(2))}
    with pytest.raises(MappingError, match="no rule consumes source keys 'extra.key'"):
        rules.apply(src)
    res = rules.apply(src, strict=False)
    assert res.unconsumed == ("extra.key",)
    assert any("my.rules:2" in line and "matched nothing" in line for line in res.report())


def test_missing_layer_and_bad_op_errors_name_the_rule():
    rules = parse_rules("l.$L.w -> w[$L]", origin="r.rules")
    with pytest.raises(MappingError, match=r"r.rules:1.*indices \[1\] are missing"):
        rules.apply({"l.0.w": ArrayTensor(arr(2)), "l.2.w": ArrayTensor(arr(2))})
    with pytest.raises(MappingError, match=r"unknown op 'explode\(3\)'"):
        parse_rules("a -> b : explode(3)")
    with pytest.raises(MappingError, match=r"r.rules:1.*split\(0, 3\)"):
        parse_rules("a -> b, c, d : split(0, 3)", origin="r.rules").apply({"a": ArrayTensor(arr(4))})


def test_load_rules_file(tmp_path):
    p = tmp_path / "user.rules"
    p.write_text("# a user's rules\nold.name -> new.name : transpose\n")
    out = load_rules(str(p)).apply({"old.name": ArrayTensor(arr(2, 3))}).tensors
    assert out["new.name"].shape == (3, 2)
    with pytest.raises(MappingError, match="missing.rules: cannot read"):
        load_rules(str(tmp_path / "missing.rules"))


def test_concat_without_sizes_inverts_to_equal_split():
    src = {"a": arr(2, 3), "b": arr(2, 3)}
    rules = parse_rules("a, b -> ab : concat(0)")
    out = rules.apply({k: ArrayTensor(v) for k, v in src.items()}).tensors
    np.testing.assert_array_equal(mat(out["ab"]), np.concatenate([src["a"], src["b"]]))
    back = rules.invert().apply(out).tensors
    for k in src:
        np.testing.assert_array_equal(mat(back[k]), src[k])
