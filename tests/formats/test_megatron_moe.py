"""Megatron-LM legacy (torch format) mixture-of-experts checkpoints: Mixtral and Qwen3-MoE.

Fixtures: tests/fixtures/megatron_moe_writer.py, from a tiny transformers Mixtral / Qwen3-MoE
(its state dict under the Hub's per-expert names), split FORWARD as Megatron saves it: tp x pp
x ep rank folders `mp_rank_TT_PPP_EEE`, local experts `ep * n + j`, SequentialMLP /
TEGroupedMLP (`weight{j}`) / GroupedMLP (`weight1`/`weight2`) layouts, the chained [dense,
experts] optimizer (torch state or distributed `distrib_optim.pt`).
Checks: our global tensors mapped by the family's Megatron rules give the transformers weights
and the moments back bit for bit; import -> Orbax -> restore on another mesh -> export gives
them back too; our logits equal transformers' forward (fp32, 1e-4) on a mesh splitting the
experts, and misplacing the expert-parallel ranks moves them far off (and changes exactly the
experts); a lost expert, an expert key no rule reads, and MoE options no family has are
one-line errors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from e2e import assert_same, roundtrip
from fixtures.megatron_moe_writer import make_moe, write_megatron_moe
from meshes import cases, fit

from hybridckpt import jobs, models
from hybridckpt.errors import FormatError, MappingError
from hybridckpt.formats.megatron.reader import read_global
from hybridckpt.formats.registry import open_source
from hybridckpt.rules import parse_rules

EMBEDDING = "embedding.word_embeddings.weight"


def _hf_rules(ref, tensors):
    c = ref.config
    variables = dict(
        vocab_size=c["vocab_size"], padded_vocab=tensors[EMBEDDING].shape[0],
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"], tied=False,
    )  # fmt: skip
    text, origin = models.family_named(ref.family).dialect("megatron").rules()
    return parse_rules(text, variables, origin=origin)


def _hf_named(path, ref):
    """(HF-named weights, HF-named slots) of the Megatron checkpoint at `path`."""
    _, tensors, opt = read_global(path)
    rules = _hf_rules(ref, tensors)
    weights = rules.apply(tensors).tensors  # strict: every source key consumed
    slots = {k: rules.apply(v).tensors for k, v in opt.slots.items()}
    return weights, slots


def _assert_same(got, want, what):
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    for k, t in got.items():
        x = t.read()
        assert x.dtype == want[k].dtype and np.array_equal(x, want[k]), f"{what} {k}"


@pytest.mark.parametrize(
    "family, experts, opts",
    [
        ("mixtral", "sequential", dict(tp=2, pp=2, ep=2)),
        ("mixtral", "te_grouped", dict(tp=2, pp=1, ep=2, dist_optim=True)),
        ("qwen3_moe", "grouped", dict(tp=2, pp=2, ep=2, dist_optim=True)),
        ("qwen3_moe", "te_grouped", dict(tp=1, pp=2, ep=2, dtype=torch.bfloat16)),
    ],
)
def test_experts_come_back_as_the_transformers_weights(tmp_path, family, experts, opts):
    ref, model = make_moe(family, seed=3)
    write_megatron_moe(str(tmp_path), ref, experts=experts, **opts)
    weights, slots = _hf_named(str(tmp_path), ref)
    if opts.get("dtype") == torch.bfloat16:  # 16-bit weights: the reference is the fp32 master
        want = {
            k: torch.from_numpy(v).to(torch.bfloat16).float().numpy()
            for k, v in ref.weights.items()
        }
        got = {k: t.read().astype(np.float32) for k, t in weights.items()}
        assert set(got) == set(want)
        for k in got:
            assert np.array_equal(got[k], want[k]), k
    else:
        _assert_same(weights, ref.weights, "weight")
    _assert_same(slots["exp_avg"], ref.exp_avg, "exp_avg")
    _assert_same(slots["exp_avg_sq"], ref.exp_avg_sq, "exp_avg_sq")
    # the per-expert names are the transformers model's fused experts, split
    sd = model.state_dict()
    prefix = "block_sparse_moe.experts" if family == "mixtral" else "mlp.experts"
    gate = "w1" if family == "mixtral" else "gate_proj"
    fused = sd["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    got = weights[f"model.layers.1.{prefix}.3.{gate}.weight"].read().astype(np.float32)
    if opts.get("dtype") != torch.bfloat16:
        assert np.array_equal(got, fused[3, : fused.shape[1] // 2])


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_logits_equal_transformers_and_need_the_ep_offsets(tmp_path, family):
    """tp2 pp2 ep2 -> our logits equal transformers' on a mesh splitting the experts over dp;
    the ep rank folders swapped (experts at the wrong global index) -> far off."""
    ref, model = make_moe(family, seed=9)
    root, swapped = str(tmp_path / "a"), str(tmp_path / "b")
    for path in (root, swapped):
        write_megatron_moe(path, ref, tp=2, pp=2, ep=2, experts="te_grouped")
    it = tmp_path / "b" / "iter_0000060"  # swapped before anything is read (open files are kept)
    for r in range(2):
        for p in range(2):
            _swap(
                str(it / f"mp_rank_{r:02d}_{p:03d}_000"), str(it / f"mp_rank_{r:02d}_{p:03d}_001")
            )
    assert open_source(root).config == models.config_from_hf(ref.config)
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    want = _logits(model, tokens)
    got = jobs.logits(root, tokens, mesh=fit("dp=2,tp=2,pp=2", keep="dp"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    wrong = jobs.logits(swapped, tokens, mesh=fit("dp=2,tp=2,pp=2", keep="dp"))
    assert np.abs(wrong - want).max() > 1000 * 1e-4


@pytest.mark.parametrize(
    "family, experts, opts, mesh_a, mesh_b",
    cases([
        (
            "mixtral",
            "sequential",
            dict(tp=2, pp=2, ep=2, dist_optim=True),
            "dp=2,tp=2,pp=2",
            "fsdp=2,tp=2",
        ),
        ("qwen3_moe", "grouped", dict(tp=2, pp=1, ep=2), "dp=2,fsdp=2,tp=2", "dp=4,pp=2"),
    ], keep="dp"),
)
def test_import_restore_export_gives_the_reference(tmp_path, family, experts, opts, mesh_a, mesh_b):
    # Qwen3-MoE with dense layers 0 and 2 (`--moe-layer-freq [0,1,0,1]`, HF `mlp_only_layers`)
    kw = dict(layers=4, mlp_only_layers=(0, 2)) if family == "qwen3_moe" else {}
    ref, _ = make_moe(family, seed=7, **kw)
    src = str(tmp_path / "megatron")
    write_megatron_moe(src, ref, experts=experts, **opts)
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b, keep="dp")
    assert_same(params, ref.weights)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == 60
    if family == "qwen3_moe":
        assert models.config_from_hf(ref.config).mlp_only_layers == (0, 2)
        assert "model.layers.2.mlp.gate_proj.weight" in params


def _swap(a: str, b: str) -> None:
    tmp = a + ".tmp"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


def test_expert_parallel_ranks_place_the_experts(tmp_path):
    """Expert-parallel rank folders swapped: every non-expert tensor still equals the
    reference, every routed expert lands on the wrong global index (the ep offset matters)."""
    ref, _ = make_moe("mixtral", seed=4)
    write_megatron_moe(str(tmp_path), ref, tp=2, ep=2, experts="te_grouped")
    it = tmp_path / "iter_0000060"
    for r in range(2):
        _swap(str(it / f"mp_rank_{r:02d}_000"), str(it / f"mp_rank_{r:02d}_001"))
    weights, _ = _hf_named(str(tmp_path), ref)
    experts = {k for k in weights if ".experts." in k}
    assert len(experts) == 2 * 4 * 3
    for k, t in weights.items():
        same = np.array_equal(t.read(), ref.weights[k])
        assert same == (k not in experts), k
    # expert e now holds expert (e + 2) % 4: the offset ep_rank * local_experts, swapped
    e0 = weights["model.layers.0.block_sparse_moe.experts.0.w2.weight"].read()
    assert np.array_equal(e0, ref.weights["model.layers.0.block_sparse_moe.experts.2.w2.weight"])


def test_a_lost_expert_or_an_unread_key_is_an_error(tmp_path):
    """An expert missing from its rank files names the layer and the expert; a shared expert the
    args do not announce is a key no rule consumes."""
    ref, _ = make_moe("qwen3_moe", seed=5)
    root = str(tmp_path / "lost")
    write_megatron_moe(root, ref, tp=2, ep=2, experts="sequential")
    for r in range(2):
        f = os.path.join(root, "iter_0000060", f"mp_rank_{r:02d}_001", "model_optim_rng.pt")
        st = torch.load(f, weights_only=False)
        for k in [k for k in st["model"] if "local_experts.1." in k and "layers.1." in k]:
            del st["model"][k]
        torch.save(st, f)
    with pytest.raises(
        FormatError, match=r"decoder\.layers\.1\.mlp\.experts\.\*\.linear_fc1.*\[3\] are missing"
    ):
        read_global(root)

    root = str(tmp_path / "shared")
    write_megatron_moe(root, ref, tp=1, ep=2, experts="te_grouped")
    for e in range(2):
        f = os.path.join(root, "iter_0000060", f"mp_rank_00_{e:03d}", "model_optim_rng.pt")
        st = torch.load(f, weights_only=False)
        st["model"]["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"] = torch.ones(4, 32)
        del st["optimizer"]  # as saved with --no-save-optim: the weights alone
        torch.save(st, f)
    _, tensors, _ = read_global(root)
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1.weight" in tensors
    with pytest.raises(MappingError, match="shared_experts.linear_fc1.weight"):
        _hf_rules(ref, tensors).apply(tensors)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(moe_shared_expert_intermediate_size=48), "shared_experts=True, .*: neither"),
        (dict(moe_router_score_function="sigmoid"), "sigmoid=True, .*: neither"),
        (dict(moe_router_enable_expert_bias=True), "expert_bias=True, .*: neither"),
        (dict(moe_layer_freq=[1, 0]), "dense_layers=True, .*: neither"),  # Mixtral has none
        (dict(moe_layer_freq=[1, 2]), "moe_layer_freq"),
        (dict(expert_tensor_parallel_size=1), "expert_tensor_parallel_size=1"),
        (dict(num_experts=5), "num_experts=5 does not divide"),
        (dict(num_experts=6), r"args say 6 experts but experts \[2, 5\] are missing"),
    ],
)
def test_moe_options_no_family_has_are_refused(tmp_path, change, match):
    from hybridckpt.formats.megatron.config import architecture

    ref, _ = make_moe("mixtral", seed=1)
    write_megatron_moe(str(tmp_path), ref, tp=2, ep=2)
    for r in range(2):
        for e in range(2):
            f = tmp_path / "iter_0000060" / f"mp_rank_{r:02d}_{e:03d}" / "model_optim_rng.pt"
            st = torch.load(f, weights_only=False)
            for k, v in change.items():
                setattr(st["args"], k, v)
            torch.save(st, f)
    with pytest.raises(FormatError, match=match):
        rd, _, _ = read_global(str(tmp_path))
        architecture(rd.args, rd.first_file)


def test_mixtral_needs_renormalised_routing(tmp_path):
    """`--moe-router-pre-softmax` (no renormalisation over the top k) is Qwen3-MoE's
    norm_topk_prob=False, which Mixtral cannot express: neither architecture matches it."""
    from hybridckpt.formats.megatron.config import architecture

    ref, _ = make_moe("qwen3_moe", seed=1, norm_topk_prob=False)
    write_megatron_moe(str(tmp_path), ref, tp=1, ep=2)
    rd, _, _ = read_global(str(tmp_path))
    assert rd.args.moe_router_pre_softmax is True
    assert architecture(rd.args, rd.first_file).hf_architecture == "Qwen3MoeForCausalLM"
    rd.args.qk_layernorm = False
    with pytest.raises(FormatError, match="pre_softmax=True.*nor"):
        architecture(rd.args, rd.first_file)


def _zero_buffers(moments: dict) -> dict:
    """The reference moments with the router's bias buffer at zero (no optimizer state)."""
    return {
        k: np.zeros_like(v) if k.endswith("e_score_correction_bias") else v
        for k, v in moments.items()
    }


def test_deepseek_v3_mla_shared_experts_and_expert_bias(tmp_path):
    """DeepSeek V3 (MLA with q_lora, a dense first layer, a shared expert, a sigmoid router
    with an expert bias over 2 groups, routed scaling) tp2 pp2 ep2: logits equal transformers';
    the expert bias matters (zeroed in transformers: far off); import -> restore -> export
    bitwise with moments (the bias buffer gets zero moments); shared experts missing from the
    rank files while args announce them -> an error naming them."""
    ref, model = make_moe("deepseek_v3", seed=9, layers=4)
    root = str(tmp_path / "ds")
    write_megatron_moe(root, ref, tp=2, pp=2, ep=2, experts="te_grouped", dist_optim=True)
    src = open_source(root)
    assert src.config == models.config_from_hf(ref.config)
    assert any("expert_bias" in n and "zero moments" in n for n in src.notes)
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    want = _logits(model, tokens)
    got = jobs.logits(root, tokens, mesh=fit("dp=2,tp=2,pp=2", keep="dp"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    assert np.abs(_logits(model, tokens) - got).max() > 1000 * 1e-4

    params, mu, nu, step = roundtrip(root, str(tmp_path), mesh_a="dp=2,tp=2", mesh_b="fsdp=2,tp=2", keep="dp")
    assert_same(params, ref.weights)
    assert_same(mu, _zero_buffers(ref.exp_avg), "exp_avg")
    assert_same(nu, _zero_buffers(ref.exp_avg_sq), "exp_avg_sq")
    assert step == 60

    lost = str(tmp_path / "lost")
    write_megatron_moe(lost, ref, tp=1, ep=2, experts="sequential")
    for e in range(2):
        f = os.path.join(lost, "iter_0000060", f"mp_rank_00_{e:03d}", "model_optim_rng.pt")
        st = torch.load(f, weights_only=False)
        for k in [k for k in st["model"] if ".shared_experts." in k]:
            del st["model"][k]
        del st["optimizer"]
        torch.save(st, f)
    with pytest.raises(MappingError, match=r"missing \['moe\.shared\.down\.kernel'"):
        jobs.logits(lost, tokens, mesh=fit("dp=2", keep="dp"))


def test_deepseek_v3_yarn(tmp_path):
    """`--rope-type yarn --rotary-scaling-factor 4 --mscale 1 --mscale-all-dim 1` (MLA's yarn,
    MLATransformerConfig's original 4096 positions, beta 32 / 1) is HF's DeepSeek yarn: logits
    equal transformers' with that rope_scaling, and differ from plain RoPE's."""
    yarn = {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    ref, model = make_moe("deepseek_v3", seed=9, layers=3, rope_scaling=yarn)
    write_megatron_moe(str(tmp_path), ref, tp=2, ep=2, experts="te_grouped")
    src = open_source(str(tmp_path))
    assert src.config == models.config_from_hf(ref.config)
    assert dict(src.config.rope_scaling)["rope_type"] == "yarn"
    tokens = np.random.default_rng(2).integers(0, 100, (2, 20)).astype(np.int32)
    want = _logits(model, tokens)
    got = jobs.logits(str(tmp_path), tokens, mesh=fit("dp=2,tp=2", keep="dp"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    _, plain = make_moe("deepseek_v3", seed=9, layers=3)
    assert np.abs(_logits(plain, tokens) - want).max() > 1000 * 1e-4
