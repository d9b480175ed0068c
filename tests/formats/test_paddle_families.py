"""PaddleNLP checkpoints of Qwen2, Qwen3 and Mistral (issue 13), hybrid-parallel and unified.

Each reference is transformers' own model of the family (perturbed: biases and q/k norms off
their init), written as PaddleNLP writes it by tests/fixtures/paddle_writer.py (structured names
`<base_model_prefix>.*`: `qwen2.`, `mistral.`, Qwen3's `model.`; Linear weights `[in, out]`; tp
shards by `_get_tensor_parallel_mappings`, biases with their weights, q/k norms replicated).
Checks: params, fp32 masters and both moments bit for bit in HF names after the reader; logits
after import equal transformers' forward (fp32, 1e-4) on `fsdp=2,tp=2,pp=2` and `tp=4`, and
differ when the family's own tensors (q/k/v biases, q/k norms) are dropped; import -> Orbax ->
restore on another mesh -> export bitwise with moments; unified checkpoints read and written back
tensor for tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from e2e import assert_same, roundtrip
from fixtures import paddle_families as pf
from fixtures import paddle_writer as pw
from fixtures.torch_common import perturbed_model
from meshes import cases, fit

from hybridckpt import jobs
from hybridckpt.formats import paddle
from hybridckpt.formats import registry as readers
from hybridckpt.formats.paddle import unified as paddle_unified
from hybridckpt.formats.paddle.write_unified import write_unified
from hybridckpt.models import rule_variables
from hybridckpt.rules import parse_rules

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TOKENS = np.array([[3, 17, 63, 0, 42, 7, 30, 5, 11, 2, 9]], dtype=np.int32)

FAMILIES = {
    # tied, q/k/v biases
    "qwen2": (lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True), "qwen2"),
    # per-head q/k norms; base_model_prefix "model"
    "qwen3": (
        lambda: transformers.Qwen3Config(**SMALL, head_dim=8, tie_word_embeddings=False),
        "model",
    ),
    "mistral": (
        lambda: transformers.MistralConfig(**SMALL, sliding_window=4, tie_word_embeddings=False),
        "mistral",
    ),
}
CASES = {
    "qwen2_tied_tp2": ("qwen2", dict(tp=2)),
    "qwen2_tp2_pp2_stage1_bf16": ("qwen2", dict(tp=2, pp=2, sharding=2, strategy="stage1", bf16=True)),
    "qwen3_fused_tp2_pp2_v2_bf16": (
        "qwen3",
        dict(tp=2, pp=2, sharding=2, strategy="v2", bf16=True, sharded_model=True, model_state=False,
             fuse_attn=True, fuse_ffn=True),
    ),
    "qwen3_tp2_raw_pp_names": ("qwen3", dict(tp=2, pp=2, raw_pp_names=True)),
    "mistral_tp2_pp2_stage2_bf16": ("mistral", dict(tp=2, pp=2, sharding=2, strategy="stage2", bf16=True)),
}  # fmt: skip


@pytest.fixture(scope="module")
def refs():
    return {name: pf.reference(make(), prefix) for name, (make, prefix) in FAMILIES.items()}


def to_hf(src):
    """(params, exp_avg, exp_avg_sq, master) of a source in HF names."""
    rules = parse_rules(src.hf_rules, {**rule_variables(src.config), **src.rule_vars})
    opt = src.optimizer
    state = [
        rules.apply(m, strict=False).tensors
        for m in (opt.slots["exp_avg"], opt.slots["exp_avg_sq"], opt.master)
    ]
    return (rules.apply(src.tensors).tensors, *state)


def materialized(d):
    return {k: v.materialize() for k, v in d.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_bitwise(tmp_path, refs, case):
    family, opts = CASES[case]
    ref, o = refs[family], pw.Options(**opts)
    pw.write_hybrid(str(tmp_path), ref, o)
    assert readers.detect(str(tmp_path)) == "paddle"
    src = paddle.open(str(tmp_path))
    assert src.config.family == family and src.topology["tp"] == o.tp
    # the family's own tensors are there, split over the tp ranks like their weights
    if family == "qwen2":
        assert "qwen2.layers.0.self_attn.k_proj.bias" in src.tensors
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in src.tensors
    params, m1, m2, master = to_hf(src)
    want = pw.expected(ref, o.bf16)
    assert_same(materialized(params), want["params"])
    assert_same(materialized(m1), want["exp_avg"], "exp_avg")
    assert_same(materialized(m2), want["exp_avg_sq"], "exp_avg_sq")
    assert_same(materialized(master), want.get("master", {}), "master")
    assert src.optimizer.step == ref.step


def _transformers_logits(config, params=None) -> np.ndarray:
    config._attn_implementation = "eager"
    model = perturbed_model(config).eval()
    if params is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=False)
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(tmp_path, refs, family):
    make, _ = FAMILIES[family]
    ref = refs[family]
    pw.write_hybrid(str(tmp_path), ref, pw.Options(tp=2))
    want = _transformers_logits(make())
    for mesh in (fit("fsdp=2,tp=2,pp=2"), fit("tp=4")):
        got = jobs.logits(str(tmp_path), TOKENS, mesh=mesh)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=mesh)
    # what the family adds matters: without its biases / q/k norms the logits are far off
    own = {
        k: (np.ones_like(v) if k.endswith("norm.weight") else np.zeros_like(v))
        for k, v in ref.params.items()
        if k.endswith(("proj.bias", "q_norm.weight", "k_norm.weight"))
    }
    if own:
        dropped = _transformers_logits(make(), {**ref.params, **own})
        assert np.abs(dropped - got).max() > 10 * 1e-4  # ten times the tolerance at least


@pytest.mark.parametrize(
    "case,mesh_a,mesh_b",
    cases([
        ("qwen2_tp2_pp2_stage1_bf16", "fsdp=2,tp=2,pp=2", "dp=2,tp=4"),
        ("qwen3_fused_tp2_pp2_v2_bf16", "tp=4,pp=2", "fsdp=8"),
        ("mistral_tp2_pp2_stage2_bf16", "fsdp=2,tp=2,pp=2", "tp=2,pp=2"),
    ]),
)
def test_import_restore_export_bitwise(tmp_path, refs, case, mesh_a, mesh_b):
    """PaddleNLP folder -> Orbax on mesh A -> restore on mesh B -> export: the fp32 masters (what a
    bf16 run steps) and both moments bit for bit, the step from the beta pows."""
    family, opts = CASES[case]
    ref = refs[family]
    src = str(tmp_path / "paddle")
    pw.write_hybrid(src, ref, pw.Options(**opts))
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, ref.params)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == ref.step


@pytest.mark.parametrize(
    "family,fuse", [("qwen2", False), ("qwen3", True), ("qwen3", False), ("mistral", False)]
)
def test_paddlenlp_unified(tmp_path, refs, family, fuse):
    """PaddleNLP's unified layout of each family (Qwen3's names are HF's there, its Linear
    weights still `[in, out]`): read bitwise, written back tensor for tensor."""
    ref = refs[family]
    pw.write_unified_fixture(str(tmp_path / "in"), ref, bf16=True, fuse_attn=fuse, fuse_ffn=fuse)
    assert readers.detect(str(tmp_path / "in")) == "paddle-unified"
    src = paddle_unified.open(str(tmp_path / "in"))
    assert src.trainer["flavour"] == "paddlenlp"
    params, m1, m2, master = to_hf(src)
    want = pw.expected(ref, True)
    assert_same(materialized(params), want["params"])
    assert_same(materialized(m1), want["exp_avg"], "exp_avg")
    assert_same(materialized(m2), want["exp_avg_sq"], "exp_avg_sq")
    assert_same(materialized(master), want["master"], "master")
    assert src.optimizer.step == ref.step
    out = str(tmp_path / "out")
    write_unified(
        out, params, config=src.config, slots={"exp_avg": m1, "exp_avg_sq": m2}, master=master,
        step=src.optimizer.step, fuse_attention_qkv=fuse, fuse_attention_ffn=fuse,
    )  # fmt: skip
    for index in ("model", "optimizer", "master_weights"):
        a = paddle_unified.read_indexed(str(tmp_path / "in"), f"{index}.safetensors.index.json")
        b = paddle_unified.read_indexed(out, f"{index}.safetensors.index.json")
        assert_same(materialized(b), materialized(a), index)


def test_unified_flavour_without_optimizer(tmp_path, refs):
    """Without optimizer files the layout decides: PaddleNLP's Qwen3 (HF-like names, `[in, out]`
    weights) read with --format paddle-unified is PaddleNLP's by the shape of mlp.gate_proj
    against the config; a PaddleFormers folder without them is a Hugging Face checkpoint."""
    import os

    from fixtures.paddle_families import write_paddleformers_unified

    ref = refs["qwen3"]
    nlp = tmp_path / "nlp"
    pw.write_unified_fixture(str(nlp), ref, bf16=False)
    for f in os.listdir(nlp):
        if f.startswith(("optimizer", "master_weights")):
            os.remove(nlp / f)
    src = readers.open_source(str(nlp), "paddle-unified")
    assert src.trainer["flavour"] == "paddlenlp"
    params = parse_rules(src.hf_rules, {**rule_variables(src.config), **src.rule_vars})
    assert_same(materialized(params.apply(src.tensors).tensors), ref.params)
    former = tmp_path / "former"
    write_paddleformers_unified(str(former), ref, bf16=False)
    for f in os.listdir(former):
        if f.startswith(("optimizer", "master_weights")):
            os.remove(former / f)
    assert readers.detect(str(former)) == "hf"
    assert readers.open_source(str(former), "paddle-unified").trainer["flavour"] == "paddleformers"


def test_paddlenlp_unified_tied_state_under_lm_head(tmp_path, refs):
    """A tied Qwen2 whose model files list the embedding under `lm_head.weight` too and whose
    moments and master are under `lm_head.weight` only (the last structured name of the shared
    parameter): the state is the embedding's, through import -> restore -> export bitwise."""
    ref = refs["qwen2"]
    src = str(tmp_path / "in")
    pw.write_unified_fixture(src, ref, bf16=True, tied_both_names=True)
    opt = paddle_unified.read_indexed(src, "optimizer.safetensors.index.json")
    assert "lm_head.weight/moment1_0" in opt and "qwen2.embed_tokens.weight/moment1_0" not in opt
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a="fsdp=2,tp=2,pp=2", mesh_b="tp=4")
    assert_same(params, ref.params)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == ref.step
