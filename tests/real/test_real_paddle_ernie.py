"""ERNIE 4.5 (MoE and dense) as PaddleFormers 1.2's Trainer saves it: a FlexCheckpoint under
PaddleFormers' own module names (fused `qkv_proj` / `up_gate_proj`, `[in, out]` Linear weights,
the router `[hidden, experts]`, the `[1, experts]` correction bias), written by the Trainer itself
(tests/real/generators/paddleformers.py, `_paddleformers_ernie.py`).

Checked against Paddle's runtime (the manifest's SHA-256 digests by HF name in HF layout, split
from PaddleFormers' tensors by the generator in numpy; PaddleFormers' own fp32 forward):
- import onto dp=1,fsdp=2,tp=2,pp=2 (fewer devices: the largest mesh of that form), restore on
  dp=2,tp=2,pp=2, export: every param and both Adam moments bit for bit, the step; the frozen
  correction bias (no optimizer state in the files) with zero moments;
- our logits equal PaddleFormers' forward of the trained model (fp32, atol 1e-4 on logits of
  order one); with the correction bias zeroed in the import the logits move (it chooses experts);
- the dialect matters: the same folder read with Llama's flex_checkpoint rules (q/k/v and
  gate/up unfused) is refused, and reading the fused qkv as [q | k | v] (not per kv group) gives
  params that are not Paddle's.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from cases import ckpt, manifest, reference
from e2e import roundtrip
from meshes import fit

import hybridckpt
from hybridckpt import jobs
from hybridckpt.errors import HybridCkptError
from hybridckpt.formats import flex_checkpoint
from hybridckpt.formats import registry as readers
from hybridckpt.formats.flex_checkpoint import reader as flex_reader
from hybridckpt.models.ernie4_5_moe.config import Ernie45MoeConfig

CASES = {"paddleformers_ernie4_5_moe": "ernie4_5_moe", "paddleformers_ernie4_5": "ernie4_5"}
MESH_A, MESH_B = "dp=1,fsdp=2,tp=2,pp=2", "dp=2,tp=2,pp=2"
LOGITS_ATOL = 1e-4  # fp32, Paddle's CPU kernels against XLA's; logits of order one


def src(case: str) -> str:
    return ckpt(case, *manifest(case)["formats"]["flex"].split("/")[1:])


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()


def assert_digests(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    bad = [k for k in want if digest(got[k]) != want[k]["sha256"] or list(np.shape(got[k])) != want[k]["shape"]]
    assert not bad, f"{what}: not Paddle's runtime values: {bad}"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    done: dict = {}

    def get(case):
        if case not in done:
            work = tmp_path_factory.mktemp(case)
            done[case] = (str(work / "orbax"), *roundtrip(src(case), str(work), mesh_a=MESH_A, mesh_b=MESH_B))
        return done[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_written_by_paddleformers_with_its_own_names(case):
    """The case is PaddleFormers 1.2's, and its model_state holds PaddleFormers' fused names."""
    m = manifest(case)
    assert m["versions"]["paddleformers"] == "1.2.0" and m["versions"]["paddlepaddle"] == "3.3.1"
    assert readers.detect(src(case)) == "flex-checkpoint"
    names = set(flex_checkpoint.open(src(case)).tensors)
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.up_gate_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    cfg = jobs.open_checkpoint(src(case)).config
    assert cfg.family == CASES[case] and cfg.tie_word_embeddings and cfg.rope_theta == 10000.0
    if case == "paddleformers_ernie4_5_moe":
        assert (cfg.moe_layers, cfg.moe_num_experts, cfg.moe_k, cfg.moe_num_shared_experts) == ((2, 3), 4, 2, 1)
        assert "model.layers.3.mlp.experts.3.up_gate_proj.weight" in names
        # frozen in Paddle (stop_gradient): a param without optimizer state
        assert m["stop_gradient"] == [f"model.layers.{i}.mlp.moe_statics.e_score_correction_bias" for i in (2, 3)]


@pytest.mark.parametrize("case", CASES)
def test_import_restore_export_bitwise(imported, case):
    """Params and both moments, on two meshes with tp and pp, are Paddle's runtime values."""
    m = manifest(case)
    _, params, mu, nu, step = imported(case)
    assert_digests(params, m["digests"]["params"], "params")
    for got, slot in ((dict(mu), "exp_avg"), (dict(nu), "exp_avg_sq")):
        for name in m["stop_gradient"]:  # frozen in Paddle: no state saved, zero moments
            assert not got.pop(name).any(), name
        assert_digests(got, m["digests"][slot], slot)
    assert step == m["steps"]
    if case == "paddleformers_ernie4_5_moe":
        bias = params["model.layers.2.mlp.moe_statics.e_score_correction_bias"]
        assert bias.shape == (1, 4) and np.abs(bias).max() > 0.1  # off zero: it changes the choice


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_paddleformers_forward(imported, case):
    ref = reference(case)
    got = hybridckpt.logits(imported(case)[0], ref["tokens"], mesh=fit(MESH_B))
    assert np.abs(ref["logits"]).max() > 0.5
    np.testing.assert_allclose(got, ref["logits"], atol=LOGITS_ATOL, rtol=0)


def test_correction_bias_chooses_experts(imported, monkeypatch):
    """The Paddle-trained correction bias changes which experts run: switched off in the router,
    our logits leave PaddleFormers' (so the bias read is the one Paddle routed with)."""
    case = "paddleformers_ernie4_5_moe"
    ref = reference(case)
    monkeypatch.setattr(Ernie45MoeConfig, "routing_bias", property(lambda self: False))
    got = hybridckpt.logits(imported(case)[0], ref["tokens"], mesh="dp=1")
    assert np.abs(got - ref["logits"]).max() > 100 * LOGITS_ATOL


# the dialect, mutated: the fused qkv read as [q | k | v] (not per kv group), gate/up swapped
MUTATIONS = {
    "qkv_not_per_kv_group": ("fused_qkv(0, {num_heads}, {num_kv_heads})", "split(0, 16, 8, 8)"),
    "gate_up_swapped": ("mlp.experts.$E.gate_proj.weight, model.layers.$L.mlp.experts.$E.up_proj.weight",
                        "mlp.experts.$E.up_proj.weight, model.layers.$L.mlp.experts.$E.gate_proj.weight"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_dialect_matters(tmp_path, monkeypatch, mutation):
    """Each fact of the dialect is needed: mutated, the import holds params that are not Paddle's
    and logits that are not PaddleFormers'. Without it (Llama's flex_checkpoint rules: q/k/v and
    gate/up unfused) the fused tensors are refused."""
    case = "paddleformers_ernie4_5_moe"
    old, new = MUTATIONS[mutation]
    real = flex_reader.hf_rules

    def mutated(cfg, notes):
        text = real(cfg, notes)
        assert old in text
        return text.replace(old, new)

    monkeypatch.setattr(flex_reader, "hf_rules", mutated)
    jobs.import_checkpoint(src(case), str(tmp_path / "orbax"), mesh="dp=1")
    ref = reference(case)
    got = hybridckpt.logits(str(tmp_path / "orbax"), ref["tokens"], mesh="dp=1")
    assert np.abs(got - ref["logits"]).max() > 100 * LOGITS_ATOL
    jobs.export_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "hf"), optimizer=False)
    params = {k: v.materialize() for k, v in readers.open_source(str(tmp_path / "hf")).tensors.items()}
    want = manifest(case)["digests"]["params"]
    bad = sorted(k for k in want if digest(params[k]) != want[k]["sha256"])
    assert bad and all((".self_attn." if mutation.startswith("qkv") else ".experts.") in k for k in bad), bad


def test_without_the_dialect_refused(tmp_path, monkeypatch):
    """Read with Llama's flex_checkpoint rules (PaddleFormers' Llama names), ERNIE's fused
    tensors have no HF name: the import is refused in one line, nothing written."""
    from hybridckpt.models.llama import FAMILY as LLAMA

    text = LLAMA.dialect("flex_checkpoint").rules_text()
    monkeypatch.setattr(flex_reader, "hf_rules", lambda cfg, notes: f"{text}\n{flex_reader.CATCH_ALL}\n")
    with pytest.raises(HybridCkptError, match="tensors are not that model's") as e:
        jobs.import_checkpoint(src("paddleformers_ernie4_5_moe"), str(tmp_path / "orbax"), mesh="dp=1")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "orbax").exists()
