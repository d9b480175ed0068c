"""ERNIE 4.5's flex_checkpoint dialect on PaddleFormers-layout tensors built here from HF ones
(what the real fixture does not hold: biases with `use_bias`, the MTP block, bias of the shared
experts' fused up_gate): each fused / `[in, out]` tensor maps back to HF's names and values
exactly, and everything else passes through. The fusion is built in numpy as PaddleFormers'
modules hold it (Ernie4_5Attention: per kv group [q heads | k | v] on the out axis; nn/mlp.py:
[gate | up]), not through our ops."""

from __future__ import annotations

import numpy as np

from hybridckpt import lazy
from hybridckpt.formats.flex_checkpoint import reader as flex_reader
from hybridckpt.models.ernie4_5_moe.config import Ernie45MoeConfig
from hybridckpt.rules import parse_rules

H, KV, HD, E, M, MX = 4, 2, 4, 8, 12, 6


def cfg() -> Ernie45MoeConfig:
    return Ernie45MoeConfig(vocab_size=16, hidden_size=E, intermediate_size=M, num_layers=2, num_heads=H,
                            num_kv_heads=KV, head_dim=HD, use_bias=True, moe_num_experts=2, moe_k=1,
                            moe_intermediate_size=MX, moe_num_shared_experts=1, moe_layer_start_index=1,
                            moe_layer_end_index=1, num_nextn_predict_layers=1)


def fuse_qkv(q, k, v):
    """HF q [H*HD, ...], k/v [KV*HD, ...] -> PaddleFormers' per-kv-group rows."""
    qs, ks, vs = (t.reshape(n, -1, *t.shape[1:]) for t, n in ((q, KV), (k, KV), (v, KV)))
    return np.concatenate([qs, ks, vs], axis=1).reshape(-1, *q.shape[1:])


def test_fused_biases_and_mtp_map_to_hf():
    rng = np.random.default_rng(0)
    c = cfg()
    hf, paddle = {}, {}
    for blk in ("model.layers.0", "model.mtp_block.0"):
        q, k, v = (rng.normal(size=(n * HD, E)) for n in (H, KV, KV))
        qb, kb, vb = (rng.normal(size=(n * HD,)) for n in (H, KV, KV))
        gate, up, down = rng.normal(size=(M, E)), rng.normal(size=(M, E)), rng.normal(size=(E, M))
        gb, ub = rng.normal(size=(M,)), rng.normal(size=(M,))
        hf |= {f"{blk}.self_attn.{n}_proj.weight": t for n, t in zip("qkv", (q, k, v), strict=True)}
        hf |= {f"{blk}.self_attn.{n}_proj.bias": t for n, t in zip("qkv", (qb, kb, vb), strict=True)}
        hf |= {f"{blk}.mlp.gate_proj.weight": gate, f"{blk}.mlp.up_proj.weight": up,
               f"{blk}.mlp.down_proj.weight": down, f"{blk}.mlp.gate_proj.bias": gb, f"{blk}.mlp.up_proj.bias": ub}
        paddle |= {f"{blk}.self_attn.qkv_proj.weight": fuse_qkv(q, k, v).T,
                   f"{blk}.self_attn.qkv_proj.bias": fuse_qkv(qb, kb, vb),
                   f"{blk}.mlp.up_gate_proj.weight": np.concatenate([gate, up]).T,
                   f"{blk}.mlp.up_gate_proj.bias": np.concatenate([gb, ub]), f"{blk}.mlp.down_proj.weight": down.T}
    sg, su, sgb, sub, sd = (rng.normal(size=s) for s in ((MX, E), (MX, E), (MX,), (MX,), (E, MX)))
    pre = "model.layers.1.mlp.shared_experts"
    hf |= {f"{pre}.gate_proj.weight": sg, f"{pre}.up_proj.weight": su, f"{pre}.gate_proj.bias": sgb,
           f"{pre}.up_proj.bias": sub, f"{pre}.down_proj.weight": sd}
    paddle |= {f"{pre}.up_gate_proj.weight": np.concatenate([sg, su]).T,
               f"{pre}.up_gate_proj.bias": np.concatenate([sgb, sub]), f"{pre}.down_proj.weight": sd.T}
    proj, router, bias = rng.normal(size=(E, 2 * E)), rng.normal(size=(2, E)), rng.normal(size=(1, 2))
    hf |= {"model.mtp_linear_proj.0.weight": proj, "model.layers.1.mlp.gate.weight": router,
           "model.layers.1.mlp.moe_statics.e_score_correction_bias": bias}
    paddle |= {"model.mtp_linear_proj.0.weight": proj.T, "model.layers.1.mlp.gate.weight": router.T,
               "model.layers.1.mlp.moe_statics.e_score_correction_bias": bias}
    from hybridckpt import models

    rules = parse_rules(flex_reader.hf_rules(c, []), models.rule_variables(c))
    got = rules.apply({k: lazy.ArrayTensor(np.ascontiguousarray(v)) for k, v in paddle.items()}).tensors
    assert sorted(got) == sorted(hf)
    bad = [n for n in hf if not np.array_equal(got[n].materialize(), hf[n])]
    assert not bad, bad
