"""PaddleFormers 1.x unified checkpoints (issue 15, part 2): HF names, Linear weights `[out, in]`,
their moments and master weights left in Paddle's `[in, out]`.

Fixtures: transformers' own model of the family (perturbed), written as PaddleFormers'
`save_single_card_checkpoint` / `save_single_card_optimizer` write it
(tests/fixtures/paddle_families.py), on a single card (one file per group) and by 2 ranks (two
files per group), fp32 and bf16 with fp32 master weights. Checks: params, masters and moments
bit for bit in HF layout; the step from the per-parameter beta pows; logits equal transformers'
forward (fp32, 1e-4); import -> Orbax -> restore on another mesh -> export bitwise, and exports
in PaddleFormers' and PaddleNLP's unified layouts (`export --to`) equal to what those tools
write, tensor for tensor.
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
from hybridckpt.cli import main
from hybridckpt.containers import safetensors_file
from hybridckpt.errors import FormatError
from hybridckpt.formats import registry as readers
from hybridckpt.formats.paddle import unified as paddle_unified

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
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=12, tie_word_embeddings=False),
    # no PaddleNLP layout of Gemma 2 exists; under HF names any family reads
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, tie_word_embeddings=True
    ),
}
CASES = {  # family, bf16 (with master weights), files per group (ranks)
    "llama_fp32_single_card": ("llama", False, 1),
    "qwen3_bf16_2_ranks": ("qwen3", True, 2),
    "gemma2_bf16_2_ranks": ("gemma2", True, 2),
}
INDEXES = ("model", "optimizer", "master_weights")


@pytest.fixture(scope="module")
def refs():
    return {name: pf.reference(make(), "model") for name, make in CONFIGS.items()}


def materialized(d):
    return {k: v.materialize() for k, v in d.items()}


def written(folder: str, index: str) -> dict[str, np.ndarray]:
    return materialized(paddle_unified.read_indexed(folder, f"{index}.safetensors.index.json"))


@pytest.mark.parametrize("case", list(CASES))
def test_read_bitwise(tmp_path, refs, case):
    family, bf16, ranks = CASES[case]
    ref = refs[family]
    pf.write_paddleformers_unified(str(tmp_path), ref, bf16=bf16, shards=ranks)
    assert readers.detect(str(tmp_path)) == "paddle-unified"
    src = paddle_unified.open(str(tmp_path))
    assert src.trainer["flavour"] == "paddleformers" and not src.hf_rules
    assert src.config.family == family
    # the files hold the moment of a Linear weight transposed: [in, out] against [out, in]
    k = "model.layers.0.self_attn.k_proj.weight"
    stored = written(str(tmp_path), "optimizer")[f"{k}/moment1_0"]
    assert stored.shape == ref.params[k].shape[::-1] != ref.params[k].shape
    want = pw.expected(ref, bf16)
    opt = src.optimizer
    assert_same(materialized(src.tensors), want["params"])
    assert_same(materialized(opt.slots["exp_avg"]), want["exp_avg"], "exp_avg")
    assert_same(materialized(opt.slots["exp_avg_sq"]), want["exp_avg_sq"], "exp_avg_sq")
    assert_same(materialized(opt.master), want.get("master", {}), "master")
    assert opt.step == ref.step == 3  # from beta1_pow_acc = 0.9 ** 4, no trainer state


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_logits_equal_transformers(tmp_path, refs, family):
    """bf16 params with fp32 masters: the masters are imported, so the logits are the fp32
    model's."""
    pf.write_paddleformers_unified(str(tmp_path), refs[family], bf16=True, shards=2)
    got = jobs.logits(str(tmp_path), TOKENS, mesh=fit("fsdp=2,tp=2,pp=2"))
    config = CONFIGS[family]()
    config._attn_implementation = "eager"
    with torch.no_grad():
        want = perturbed_model(config).eval()(torch.from_numpy(TOKENS).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "case,mesh_a,mesh_b",
    cases([
        ("qwen3_bf16_2_ranks", "fsdp=2,tp=2,pp=2", "dp=2,tp=4"),
        ("llama_fp32_single_card", "tp=4,pp=2", "fsdp=8"),
    ]),
)
def test_import_restore_export_bitwise(tmp_path, refs, case, mesh_a, mesh_b):
    """PaddleFormers folder -> Orbax on mesh A -> restore on mesh B -> export: the masters (the
    params of a bf16 run) and moments bit for bit; exported back in PaddleFormers' layout (bf16
    params + fp32 masters when the run was bf16), every file's tensors equal the source's."""
    family, bf16, ranks = CASES[case]
    ref = refs[family]
    src = str(tmp_path / "src")
    pf.write_paddleformers_unified(src, ref, bf16=bf16, shards=ranks)
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, ref.params)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == ref.step
    out = str(tmp_path / "paddleformers")
    jobs.export_checkpoint(
        str(tmp_path / "orbax"), out, optimizer=True, to="paddleformers-unified",
        dtype="bfloat16" if bf16 else None,
    )  # fmt: skip
    assert paddle_unified.open(out).trainer["flavour"] == "paddleformers"
    for index in INDEXES[: 3 if bf16 else 2]:
        assert_same(written(out, index), written(src, index), index)


def test_cli_export_to_paddlenlp_unified(tmp_path, refs):
    """`export --to paddlenlp-unified` of a PaddleFormers import: PaddleNLP's names and layouts,
    equal to what PaddleNLP's writer makes of the same model, U16 bf16 params and fp32 masters."""
    ref = pw.Reference(**{**refs["llama"].__dict__, "prefix": "llama"})
    src, ckpt, out = (str(tmp_path / n) for n in ("src", "orbax", "out"))
    pf.write_paddleformers_unified(src, ref, bf16=True, shards=2)
    assert main(["import", src, ckpt, "--mesh", fit("tp=2"), "--quiet"]) == 0
    args = ["export", ckpt, out, "--optimizer", "--dtype", "bfloat16", "--to", "paddlenlp-unified"]
    assert main([*args, "--quiet"]) == 0
    want = str(tmp_path / "paddlenlp")
    pw.write_unified_fixture(want, ref, bf16=True)
    for index in INDEXES:
        assert_same(written(out, index), written(want, index), index)
    first = paddle_unified.read_indexed(out, "model.safetensors.index.json")
    assert np.dtype(next(iter(first.values())).dtype) == np.uint16  # bf16 stored as U16 bits
    assert paddle_unified.open(out).trainer["flavour"] == "paddlenlp"


def test_moment_in_the_wrong_layout_is_named(tmp_path, refs):
    """A moment of a Linear weight stored in the weight's own layout is one FormatError naming
    the file, the key, the expected and the found shape."""
    ref = refs["llama"]
    pf.write_paddleformers_unified(str(tmp_path), ref, bf16=False)
    path = tmp_path / "optimizer-00001-of-00001.safetensors"
    tensors = written(str(tmp_path), "optimizer")
    k = "model.layers.0.mlp.down_proj.weight"
    tensors[f"{k}/moment2_0"] = np.ascontiguousarray(tensors[f"{k}/moment2_0"].T)
    safetensors_file.write(str(path), tensors, {"format": "np"})
    with pytest.raises(
        FormatError, match=rf"optimizer\.safetensors\.index\.json.*{k}.*expected \(48, 32\)"
    ):
        paddle_unified.open(str(tmp_path))


@pytest.mark.parametrize(
    "model_files,tied_both_names",
    [(False, False), (True, True), (False, True)],
    ids=["skip_save_model_weight", "tied_state_under_lm_head", "both"],
)
def test_masters_as_params_and_tied_state(tmp_path, refs, model_files, tied_both_names):
    """A save without model files ("skip_save_model_weight") imports the masters as the params;
    a tied embedding's state saved under `lm_head.weight` (its last structured name) is the
    embedding's. Both then go through import -> restore -> export bit for bit."""
    ref = refs["gemma2"]  # tied
    src = str(tmp_path / "src")
    pf.write_paddleformers_unified(
        src, ref, bf16=True, shards=2, model_files=model_files, tied_both_names=tied_both_names
    )
    assert readers.detect(src) == "paddle-unified"
    opened = paddle_unified.open(src)
    if not model_files:
        assert any("master weights" in n for n in opened.notes)
    if tied_both_names:
        raw = written(src, "optimizer")
        assert (
            "lm_head.weight/moment1_0" in raw and "model.embed_tokens.weight/moment1_0" not in raw
        )
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a="fsdp=2,tp=2,pp=2", mesh_b="tp=4")
    assert_same(params, ref.params)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == ref.step
