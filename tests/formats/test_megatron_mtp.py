"""Megatron DeepSeek V3 checkpoints with MTP layers (`--mtp-num-layers 1`): legacy torch format
and torch_dist.

Fixture: tests/fixtures/megatron_moe_writer.py from a tiny transformers DeepSeek V3 (MLA, a dense
first layer, MoE with a shared expert and an expert bias) plus one MTP module under the Hub's
names (`model.layers.{L}.*`: an MoE decoder layer, enorm, hnorm, eh_proj, shared_head.norm, and
copies of the embedding and head), split as Megatron saves it: `mtp.layers.0.{enorm, hnorm,
eh_proj (rows over tp), transformer_layer.*, final_layernorm}` on the last pipeline stage, its
experts over the ep ranks, the embedding / output layer not stored again; torch_dist
(tests/fixtures/megatron_dist_moe_writer.py): the same keys with global offsets, no layer axis,
the experts' prepended expert axis (or per-expert singleton keys).
Checks: the MTP params and their moments come back bit for bit under the HF names; import ->
restore on another mesh -> export is bitwise with them; logits still equal transformers' (which
has no MTP); an eh_proj stored with its halves in the other order ([h | e]) no longer equals
the expected HF tensor (the comparison catches a wrong concat order).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from e2e import assert_same, roundtrip
from fixtures.megatron_dist_moe_writer import write_torch_dist_moe
from fixtures.megatron_moe_writer import make_moe, write_megatron_moe
from meshes import fit

from hybridckpt import jobs, models
from hybridckpt.errors import FormatError
from hybridckpt.formats.registry import open_source
from hybridckpt.naming import source_to_hf

L = 4  # decoder layers (1 dense, 3 MoE): MTP module 0 is HF layer 4


def _zero_buffers(moments: dict) -> dict:
    """The reference moments with the routers' bias buffers at zero (no optimizer state)."""
    return {
        k: np.zeros_like(v) if k.endswith("e_score_correction_bias") else v
        for k, v in moments.items()
    }


def _hf(root):
    src = open_source(root)
    return src, source_to_hf(src, src.config)


@pytest.fixture(scope="module")
def mtp_ref():
    return make_moe("deepseek_v3", seed=5, layers=L, mtp=True)


@pytest.mark.parametrize(
    "opts",
    [
        dict(tp=2, pp=2, ep=2, experts="te_grouped", dist_optim=True),
        dict(tp=2, pp=1, ep=1, experts="sequential", mtp_layer_name="mtp_model_layer"),
    ],
)
def test_mtp_layers_come_back_under_the_hf_names(tmp_path, mtp_ref, opts):
    ref, _ = mtp_ref
    mtp_keys = {k for k in ref.weights if k.startswith(f"model.layers.{L}.")}
    assert {f"model.layers.{L}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj")} <= mtp_keys
    assert any(".mlp.experts.3." in k for k in mtp_keys)  # experts inside the MTP layer
    write_megatron_moe(str(tmp_path), ref, **opts)
    src, named = _hf(str(tmp_path))
    assert src.config.mtp_layers == 1 and src.config.num_nextn_predict_layers == 1
    got = {k: t.read() for k, t in named.params.items()}
    assert_same(got, ref.weights)
    for slot, want in (("exp_avg", ref.exp_avg), ("exp_avg_sq", ref.exp_avg_sq)):
        assert_same({k: t.read() for k, t in named.slots[slot].items()}, _zero_buffers(want), slot)


def test_mtp_import_restore_export_and_logits(tmp_path, mtp_ref):
    """tp2 pp2 ep2 (MTP on the last stage, its experts over ep): logits equal transformers'
    (MTP unused); import -> restore on another mesh -> export bitwise incl. MTP and moments."""
    ref, model = mtp_ref
    root = str(tmp_path / "ds")
    write_megatron_moe(root, ref, tp=2, pp=2, ep=2, experts="sequential", dist_optim=True)
    assert open_source(root).config == models.config_from_hf(ref.config)
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(root, tokens, mesh=fit("dp=2,tp=2,pp=2"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    params, mu, nu, step = roundtrip(root, str(tmp_path), mesh_a="dp=2,tp=2", mesh_b="fsdp=2,tp=2")
    assert any(k.startswith(f"model.layers.{L}.") for k in params)
    assert_same(params, ref.weights)
    assert_same(mu, _zero_buffers(ref.exp_avg), "exp_avg")
    assert_same(nu, _zero_buffers(ref.exp_avg_sq), "exp_avg_sq")
    assert step == 60


def test_a_wrong_eh_proj_concat_order_is_caught(tmp_path, mtp_ref):
    """Megatron's MTP input is torch.cat((embedding, hidden), -1) (multi_token_prediction.py),
    as HF's: eh_proj's columns [e | h] map unpermuted. Stored [h | e] it is read back, but no
    longer equals the expected HF tensor."""
    ref, _ = mtp_ref
    name = f"model.layers.{L}.eh_proj.weight"
    root = str(tmp_path / "swapped")
    write_megatron_moe(root, ref, tp=2, pp=1, ep=1, experts="sequential")
    h = ref.weights[name].shape[0]
    for r in range(2):
        f = os.path.join(root, "iter_0000060", f"mp_rank_{r:02d}", "model_optim_rng.pt")
        st = torch.load(f, weights_only=False)
        w = st["model"]["mtp.layers.0.eh_proj.weight"]
        st["model"]["mtp.layers.0.eh_proj.weight"] = torch.cat([w[:, h:], w[:, :h]], dim=1)
        torch.save(st, f)
    _, named = _hf(root)
    got = named.params[name].read()
    want = ref.weights[name]
    assert not np.array_equal(got, want)
    assert np.array_equal(got, np.concatenate([want[:, h:], want[:, :h]], axis=1))


@pytest.mark.parametrize("singleton", [False, True])
def test_torch_dist_mtp_layers_with_their_moments(tmp_path, mtp_ref, singleton):
    """torch_dist tp2 pp2 ep2, fully_reshardable optimizer: MTP params and moments bitwise under
    the HF names; logits equal transformers'."""
    ref, model = mtp_ref
    root = str(tmp_path / "d")
    write_torch_dist_moe(root, ref, tp=2, pp=2, ep=2, experts="te_grouped", singleton=singleton)
    src, named = _hf(root)
    assert src.config.mtp_layers == 1
    assert_same({k: t.read() for k, t in named.params.items()}, ref.weights)
    for slot, want in (("exp_avg", ref.exp_avg), ("exp_avg_sq", ref.exp_avg_sq)):
        assert_same({k: t.read() for k, t in named.slots[slot].items()}, _zero_buffers(want), slot)
    tokens = np.random.default_rng(4).integers(0, 100, (2, 7)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(jobs.logits(root, tokens, mesh=fit("dp=2,tp=2")), want, atol=1e-4, rtol=0)


def test_torch_dist_mtp_with_dp_reshardable_state_reads_the_weights_only(tmp_path, mtp_ref):
    """The dp_reshardable buckets with MTP layers are not modelled: the weights convert, the
    optimizer is left out with a note saying so."""
    ref, _ = mtp_ref
    root = str(tmp_path / "d")
    write_torch_dist_moe(root, ref, tp=2, pp=2, ep=2, optim="dp_reshardable")
    src, named = _hf(root)
    assert src.optimizer is None
    assert any("MTP" in n and "NOT read" in n for n in src.notes)
    assert_same({k: t.read() for k, t in named.params.items()}, ref.weights)


def test_a_repeated_mtp_layer_is_refused(tmp_path, mtp_ref):
    """`--mtp-use-repeated-layer` stores one MTP layer for all depths: no HF layout holds it."""
    ref, _ = mtp_ref
    write_megatron_moe(str(tmp_path), ref, tp=1, ep=1)
    f = os.path.join(str(tmp_path), "iter_0000060", "mp_rank_00", "model_optim_rng.pt")
    st = torch.load(f, weights_only=False)
    st["args"].mtp_num_layers, st["args"].mtp_use_repeated_layer = 2, True
    torch.save(st, f)
    with pytest.raises(FormatError, match="mtp_use_repeated_layer with mtp_num_layers=2"):
        open_source(str(tmp_path))


def test_the_mtp_stage_embedding_copy_is_checked_and_dropped(tmp_path, mtp_ref):
    """pp2: the last (MTP) stage keeps its own copy of the embedding (gpt_model.py); it must
    equal the first stage's, and is dropped (with its moments) once checked."""
    ref, _ = mtp_ref
    write_megatron_moe(str(tmp_path), ref, tp=1, pp=2, ep=1)
    f = os.path.join(str(tmp_path), "iter_0000060", "mp_rank_00_001", "model_optim_rng.pt")
    st = torch.load(f, weights_only=False)
    assert "embedding.word_embeddings.weight" in st["model"]
    src = open_source(str(tmp_path))
    assert any("mtp_stage.embedding" in n and "dropped" in n for n in src.notes)
    st["model"]["embedding.word_embeddings.weight"][5, 0] += 1.0
    torch.save(st, f)
    with pytest.raises(FormatError, match="row 5 differs"):
        open_source(str(tmp_path))
