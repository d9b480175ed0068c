"""The head-regrouping ops (`interleave`, `gated_qkv`) and `shift`: against numpy references of
the layouts Megatron-Bridge documents, inverses exact, a moment not shifted, bad sizes one line."""

import numpy as np
import pytest

from hybridckpt.errors import MappingError
from hybridckpt.lazy import ArrayTensor
from hybridckpt.rules import Op, parse_rules

rng = np.random.default_rng(1)


def arr(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def _roundtrip(rules, src):
    out = rules.apply({k: ArrayTensor(v) for k, v in src.items()})
    back = rules.invert().apply_unstack(out.tensors)
    for k, v in src.items():
        np.testing.assert_array_equal(back.tensors[k].materialize(), v)
    return {k: v.materialize() for k, v in out.tensors.items()}


def test_interleave_groups_per_key_head_as_bridge_splits():
    """Bridge `split_gdn_linear_weights` (tp 1): per key head [q_h; k_h; v_h; z_h]."""
    nk, dk, vg, hidden = 3, 2, 4, 5
    q, k, v, z = (
        arr(nk * dk, hidden),
        arr(nk * dk, hidden),
        arr(nk * vg, hidden),
        arr(nk * vg, hidden),
    )
    want = np.concatenate(
        [np.concatenate([x.reshape(nk, -1, hidden)[h] for x in (q, k, v, z)]) for h in range(nk)]
    )
    rules = parse_rules("q, k, v, z -> qkvz : interleave(0, 3, 2, 2, 4, 4)")
    got = _roundtrip(rules, {"q": q, "k": k, "v": v, "z": z})["qkvz"]
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, np.concatenate([q, k, v, z]))  # the plain concat would be wrong


def test_gated_qkv_gives_hf_q_proj_per_head():
    """Megatron's per group [q heads | gate heads | k | v] -> HF q_proj per head [q_h; gate_h]."""
    heads, kv, hd, hidden = 4, 2, 3, 5
    per = heads // kv
    q, g = arr(heads, hd, hidden), arr(heads, hd, hidden)
    k, v = arr(kv, hd, hidden), arr(kv, hd, hidden)
    fused = np.concatenate([np.concatenate([q[i * per:(i + 1) * per].reshape(-1, hidden),
                                            g[i * per:(i + 1) * per].reshape(-1, hidden), k[i], v[i]])
                            for i in range(kv)])  # fmt: skip
    rules = parse_rules("qkv -> qp, kp, vp : gated_qkv(0, 4, 2)")
    out = _roundtrip(rules, {"qkv": fused})
    np.testing.assert_array_equal(out["qp"], np.concatenate([q, g], axis=1).reshape(-1, hidden))
    np.testing.assert_array_equal(out["kp"], k.reshape(-1, hidden))
    np.testing.assert_array_equal(out["vp"], v.reshape(-1, hidden))


def test_shift_adds_exactly_and_leaves_moments():
    w = (1.0 + 0.1 * arr(6)).astype(np.float32)
    rules = parse_rules("n -> m : shift(1)")
    got = _roundtrip(rules, {"n": w - 1})["m"]
    np.testing.assert_array_equal(got, w)
    assert Op("shift", (1,)).for_slot("exp_avg_sq") == Op("identity")


@pytest.mark.parametrize(
    "text, shapes, match",
    [
        ("a, b -> c : interleave(0, 2, 3, 3)", {"a": (6, 2), "b": (5, 2)}, "not 2 blocks of 3"),
        ("a, b -> c : interleave(0, 2, 3)", {"a": (6, 2), "b": (6, 2)}, "needs 2 block sizes"),
        ("a, b -> c : interleave(0, 0, 3, 3)", {"a": (6, 2), "b": (6, 2)}, "positive"),
        ("a -> q, k, v : gated_qkv(0, 4, 2)", {"a": (13, 2)}, "not a multiple of 12"),
        ("a -> q, k, v : gated_qkv(0, 3, 2)", {"a": (12, 2)}, "not a multiple of kv_heads"),
    ],
)
def test_bad_sizes_are_one_mapping_error(text, shapes, match):
    rules = parse_rules(text)
    with pytest.raises(MappingError, match=match):
        rules.apply({k: ArrayTensor(np.zeros(s, np.float32)) for k, s in shapes.items()})
