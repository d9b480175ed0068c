"""Paddle AOA key-mapping configs as `--rules`: translated into hybridckpt's rules language
(`hybridckpt.rules.aoa`), applied stage by stage, and reversed.

The statements of `PADDLE_TESTS` are copied from Paddle's own tests
(PaddlePaddle/Paddle: test/flex_checkpoint/test_macros.py, test_aoa_engine.py,
model_full_param_logic.py); the expected layouts are the expansions those tests assert (the
order of the per-head / per-shard pieces). The checkpoint test uses the same statement forms
(`TestFusedQKVMacro`, `TestFusedFfnMacro2`) with a Llama's names on a FlexCheckpoint saved with
fused q/k/v and gate/up under TP 2 (so `fused_ffn` sees 2 source shards).

Checked once against paddlepaddle 3.3.1 in a side venv: Paddle's own `AOAEngine`, given the
statements of `PADDLE_TESTS` and the same source shard layout, resolves every output to exactly
the values this translation produces (`find_shard_sources`, slices assembled with numpy).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from fixtures import flex_writer as fw
from fixtures import paddle_writer as pw
from meshes import fit

from hybridckpt import jobs, lazy
from hybridckpt.errors import HybridCkptError, MappingError
from hybridckpt.io.byte_source import close_all
from hybridckpt.lazy import tiled
from hybridckpt.rules import aoa, parse_rules
from hybridckpt.rules.user import load_user_rules

PADDLE_TESTS = """\
# test_macros.py TestFusedQKVMacro
layers.1.self_attn.qkv_proj.weight -> Q, K, V, fused_qkv, num_heads = 8, num_key_value_groups = 2
# test_macros.py TestFusedFfnMacro2 (the source is stored as 2 shards)
layers.0.mlp.gate_up_fused_proj.weight -> layers.0.mlp.gate_proj.weight,layers.0.mlp.up_proj.weight, fused_ffn
# test_macros.py TestTransposeMacro
layers.1.mlp.down_proj.weight^T -> layers.1.mlp.down_proj.weight_T
# test_macros.py TestStarMacro
layers.1.experts.*.weight -> fused_experts, axis = 1
# test_aoa_engine.py test_aoa_spilt_merge
s0, s1 -> s, axis = 1
s -> d0, d1, axis = 0
# model_full_param_logic.py run_full_param_with_aoa_test
_layers.linear1.weight, _layers.linear2.weight -> _layers.fused_weight, axis=1
"""


def _arange(shape, start=0):
    return lazy.ArrayTensor(
        np.arange(start, start + np.prod(shape), dtype=np.float32).reshape(shape)
    )


def _source():
    """Tensors named as Paddle's tests name them; gate_up is stored as 2 column blocks."""
    t = {
        "layers.1.self_attn.qkv_proj.weight": _arange((4, 12 * 3)),  # 8 q + 2 k + 2 v heads, hd 3
        "layers.1.mlp.down_proj.weight": _arange((5, 3)),
        "layers.1.experts.0.weight": _arange((2, 3)),
        "layers.1.experts.1.weight": _arange((2, 3), 100),
        "s0": _arange((2, 2)),
        "s1": _arange((2, 2), 10),
        "_layers.linear1.weight": _arange((3, 3)),
        "_layers.linear2.weight": _arange((3, 3), 50),
        "untouched": _arange((7,)),
    }
    fused = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)  # [g0 | u0 | g1 | u1], 4 each
    t["layers.0.mlp.gate_up_fused_proj.weight"] = tiled(
        (4, 16),
        np.float32,
        [((0, 0), lazy.ArrayTensor(fused[:, :8])), ((0, 8), lazy.ArrayTensor(fused[:, 8:]))],
    )
    return t


def test_paddle_test_statements_translate_as_paddle_expands_them(tmp_path):
    path = tmp_path / "paddle_tests.aoa"
    path.write_text(PADDLE_TESTS)
    src = _source()
    chain = aoa.load(str(path), source=src)
    out = {k: v.materialize() for k, v in chain.apply(src).tensors.items()}
    qkv = src["layers.1.self_attn.qkv_proj.weight"].materialize()
    heads = np.split(qkv, 12, axis=1)  # Q0 Q1 Q2 Q3 K0 V0 Q4 Q5 Q6 Q7 K1 V1 (TestFusedQKVMacro)
    order = {"Q": [0, 1, 2, 3, 6, 7, 8, 9], "K": [4, 10], "V": [5, 11]}
    for name, idx in order.items():
        assert np.array_equal(out[name], np.concatenate([heads[i] for i in idx], axis=1)), name
    fused = src["layers.0.mlp.gate_up_fused_proj.weight"].materialize()
    g0, u0, g1, u1 = np.split(fused, 4, axis=1)  # GATE_0, UP_0, GATE_1, UP_1 (TestFusedFfnMacro2)
    assert np.array_equal(out["layers.0.mlp.gate_proj.weight"], np.concatenate([g0, g1], 1))
    assert np.array_equal(out["layers.0.mlp.up_proj.weight"], np.concatenate([u0, u1], 1))
    assert np.array_equal(
        out["layers.1.mlp.down_proj.weight_T"], src["layers.1.mlp.down_proj.weight"].materialize().T
    )
    e0, e1 = (src[f"layers.1.experts.{i}.weight"].materialize() for i in (0, 1))
    assert np.array_equal(out["fused_experts"], np.concatenate([e0, e1], axis=1))
    s = np.concatenate([src["s0"].materialize(), src["s1"].materialize()], axis=1)
    assert np.array_equal(out["d0"], s[:1]) and np.array_equal(out["d1"], s[1:])
    l1, l2 = (src[f"_layers.linear{i}.weight"].materialize() for i in (1, 2))
    assert np.array_equal(out["_layers.fused_weight"], np.concatenate([l1, l2], axis=1))
    assert np.array_equal(out["untouched"], src["untouched"].materialize())
    assert set(out) == {
        "Q",
        "K",
        "V",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.1.mlp.down_proj.weight_T",
        "fused_experts",
        "d0",
        "d1",
        "_layers.fused_weight",
        "untouched",
    }
    # the reverse (aoa_config_reverse) gives every source tensor back, bit for bit
    back = aoa.load(str(path), source=src, reverse=True).apply(chain.apply(src).tensors).tensors
    assert set(back) == set(src)
    for k, v in src.items():
        assert np.array_equal(back[k].materialize(), v.materialize()), k
    # a gate_up stored as ONE shard is [gate | up]: the shard count decides the layout
    one = dict(src, **{"layers.0.mlp.gate_up_fused_proj.weight": lazy.ArrayTensor(fused)})
    flat = aoa.load(str(path), source=one).apply(one).tensors
    assert np.array_equal(flat["layers.0.mlp.gate_proj.weight"].materialize(), fused[:, :8])


AOA_LLAMA = """\
# Paddle's test_macros.py statement forms (TestFusedQKVMacro, TestFusedFfnMacro2) with a Llama's names
model.layers.$LAYER_ID.self_attn.qkv_proj.weight -> model.layers.$LAYER_ID.self_attn.q_proj.weight, model.layers.$LAYER_ID.self_attn.k_proj.weight, model.layers.$LAYER_ID.self_attn.v_proj.weight, fused_qkv, num_heads = 4, num_key_value_groups = 2
model.layers.$LAYER_ID.mlp.gate_up_fused_proj.weight -> model.layers.$LAYER_ID.mlp.gate_proj.weight, model.layers.$LAYER_ID.mlp.up_proj.weight, fused_ffn
embedding.weight -> model.embed_tokens.weight
"""


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    root = tmp_path_factory.mktemp("aoa")
    ref = pw.reference_llama(3)
    o = fw.Options(
        tp=2,
        sharding=2,
        strategy="v2",
        bf16=True,
        fused=True,
        rename={"model.embed_tokens.weight": "embedding.weight"},
    )
    ckpt, want = fw.write_output_folder(str(root / "run"), ref, o)
    rules = root / "llama.aoa"
    rules.write_text(AOA_LLAMA)
    return ref, ckpt, want, str(rules)


def test_fused_checkpoint_needs_the_aoa_config(fused):
    ref, ckpt, want, rules = fused
    with pytest.raises(HybridCkptError):
        jobs.open_checkpoint(ckpt)
    from hybridckpt.cli import main

    out = os.path.join(os.path.dirname(rules), "cli-import")
    assert main(["import", ckpt, out, "--rules", rules, "--mesh", fit("tp=2"), "--quiet"]) == 0
    opened = jobs.open_checkpoint(ckpt, rules=rules)
    for kind, d in (
        ("params", opened.named.params),
        *((s, opened.named.slots[s]) for s in ("exp_avg", "exp_avg_sq")),
    ):
        expect = want["master"] if kind == "params" else want[kind]
        assert sorted(d) == sorted(expect), kind
        for k, v in expect.items():
            assert np.array_equal(d[k].materialize(), v), (kind, k)
    close_all()


def test_import_export_and_the_reverse_round_trip_bitwise(fused, tmp_path):
    """Import with the AOA config -> Orbax -> export (HF, single card) -> back through the
    inverse of the format's rules and the AOA reverse: the stored fused tensors (fp32 masters
    and moments, interleaved gate/up of 2 TP shards) bit for bit."""
    from hybridckpt.containers.safetensors_file import read_header
    from hybridckpt.formats import flex_checkpoint

    ref, ckpt, want, rules = fused
    jobs.import_checkpoint(ckpt, str(tmp_path / "orbax"), mesh=fit("fsdp=2,tp=2,pp=2"), rules=rules)
    jobs.export_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "out"), optimizer=True)
    model = read_header(str(tmp_path / "out" / "model.safetensors")).tensors
    opt = read_header(str(tmp_path / "out" / "optimizer.safetensors")).tensors
    exported = {
        "master": dict(model),
        "exp_avg": {k[: -len(".exp_avg")]: t for k, t in opt.items() if k.endswith(".exp_avg")},
        "exp_avg_sq": {
            k[: -len(".exp_avg_sq")]: t for k, t in opt.items() if k.endswith(".exp_avg_sq")
        },
    }
    src = flex_checkpoint.open(ckpt)
    to_flex = parse_rules(src.hf_rules, {"tied": False}).invert()
    reverse = aoa.load(rules, source=dict(src.optimizer.master), reverse=True)
    for kind, tensors in exported.items():
        back = reverse.apply(to_flex.apply(tensors).tensors).tensors
        stored = want["stored"][kind]
        assert sorted(back) == sorted(stored), kind
        for k, v in stored.items():
            got = back[k].materialize()
            assert got.dtype == v.dtype and np.array_equal(got, v), (kind, k)
    close_all()


@pytest.mark.parametrize(
    "line, match",
    [
        ("a, b -> c, d, axis=0", "many names on both sides"),
        ("a -> b^T", "cannot assign to a transpose"),
        ("a -> b, colour='red'", r"unsupported attributes \['colour'\]"),
        ("a -> b, c", "one attribute, axis"),
        ("a -> b -> c", "expected one '->'"),
        ("q -> a, b, fused_qkv, num_heads=3, num_key_value_groups=2", "divisible"),
        ("a -> b, %", "unexpected character"),
    ],
)
def test_statements_that_cannot_be_expressed_name_the_line(tmp_path, line, match):
    path = tmp_path / "bad.aoa"
    path.write_text(f"x -> y\n\n{line}\n")
    with pytest.raises(MappingError, match=rf"bad\.aoa:3: .*{match}"):
        aoa.load(str(path))


def test_one_way_cast_cannot_be_reversed_but_src_dst_dtype_can(tmp_path):
    src = {"w": _arange((2, 2))}
    one_way = tmp_path / "cast.aoa"
    one_way.write_text("w -> w16, dtype='bfloat16'\n")
    assert aoa.load(str(one_way), source=src).apply(src).tensors["w16"].dtype.name == "bfloat16"
    with pytest.raises(MappingError, match=r"cast\.aoa:1: .*cannot be reversed"):
        aoa.load(str(one_way), source=src, reverse=True)
    both = tmp_path / "cast2.aoa"
    both.write_text("w -> w16, src_dtype='float32', dst_dtype='bfloat16'\n")
    fwd = aoa.load(str(both), source=src).apply(src).tensors
    back = aoa.load(str(both), source=src, reverse=True).apply(fwd).tensors
    assert back["w"].dtype == np.float32 and np.array_equal(
        back["w"].materialize(), src["w"].materialize()
    )


def test_statements_that_need_the_checkpoint(tmp_path):
    path = tmp_path / "star.aoa"
    path.write_text("e.*.w -> all, axis=0\n")
    with pytest.raises(MappingError, match=r"star\.aoa:1: .*needs the checkpoint's keys"):
        aoa.load(str(path))
    with pytest.raises(MappingError, match=r"star\.aoa:1: .*no key matches 'e\.\*\.w'"):
        aoa.load(str(path), source={"x": _arange((2,))})
    off = tmp_path / "offset.aoa"
    off.write_text("a.$LAYER_ID_OFFSET.w -> b.$LAYER_ID_OFFSET.w\n")
    src = {"a.1.w": _arange((2,)), "a.2.w": _arange((2,), 5)}
    out = aoa.load(str(off), source=src).apply(src).tensors
    assert sorted(out) == ["b.0.w", "b.1.w"] and out["b.1.w"] is src["a.2.w"]


def test_detection_by_extension_json_and_syntax(tmp_path):
    (tmp_path / "a.aoa").write_text("x -> y\n")
    (tmp_path / "b.json").write_text(json.dumps({"aoa_statements": ["x -> y, permute='[1, 0]'"]}))
    (tmp_path / "c.txt").write_text("layers.$LAYER_ID.w^T -> layers.$LAYER_ID.v\n")
    (tmp_path / "ours.rules").write_text("layers.$L.w -> layers.$L.v : transpose\n* -> *\n")
    for name in ("a.aoa", "b.json", "c.txt"):
        assert aoa.is_aoa_file(str(tmp_path / name)), name
    assert not aoa.is_aoa_file(str(tmp_path / "ours.rules"))
    src = {"x": _arange((2, 3)), "layers.0.w": _arange((2, 3))}
    b = load_user_rules(str(tmp_path / "b.json"), {}, src).apply(src).tensors
    assert b["y"].shape == (3, 2)
    c = load_user_rules(str(tmp_path / "c.txt"), {}, src).apply(src).tensors
    assert np.array_equal(c["layers.0.v"].materialize(), src["layers.0.w"].materialize().T)
    ours = load_user_rules(str(tmp_path / "ours.rules"), {}, src)
    assert not isinstance(ours, aoa.RuleChain)
    assert os.path.basename(ours.origin) == "ours.rules"
