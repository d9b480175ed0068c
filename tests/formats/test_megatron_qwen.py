"""Megatron-LM legacy checkpoints of Qwen2 (`--add-qkv-bias`) and Qwen3 (`--qk-layernorm`).

Fixtures are written by tests/fixtures/megatron_writer.py (`make_qwen`: Llama's layout plus the
biases or q/k norms, split forward as Megatron saves them, independently of the .rules files).
Checks: the args give the family's config; import -> Orbax -> restore on another mesh -> export
gives the unsplit reference back bit for bit, moments too; our logits of the Megatron checkpoint
equal transformers' forward on the reference within 1e-4 (fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from e2e import assert_same, roundtrip
from fixtures.megatron_writer import make_qwen, write_megatron
from meshes import cases, fit

from hybridckpt import jobs, models
from hybridckpt.errors import FormatError
from hybridckpt.formats.registry import open_source

SIZES = dict(hidden=64, layers=4, heads=8, kv_heads=4, ffn=96, vocab=100)  # GQA, tp up to 4
QWEN3_HEAD_DIM = 12  # heads * head_dim = 96 != hidden 64, as Qwen3's explicit head_dim allows


def _ref(family: str, seed: int, tied: bool = False):
    head_dim = QWEN3_HEAD_DIM if family == "qwen3" else None
    return make_qwen(family, **SIZES, tied=tied, seed=seed, head_dim=head_dim)


@pytest.mark.parametrize(
    "family, opts, mesh_a, mesh_b",
    cases([
        ("qwen2", dict(tp=2, pp=2, dist_optim=True), "fsdp=2,tp=2,pp=2", "tp=4,pp=2"),
        ("qwen2", dict(tp=4, pp=1, keys="legacy"), "dp=1", "fsdp=2,tp=2,pp=2"),
        ("qwen3", dict(tp=4, pp=2, vpp=2, dtype=torch.bfloat16), "tp=4,pp=2", "dp=1"),
        ("qwen3", dict(tp=2, pp=1, dist_optim=True), "fsdp=2,tp=2,pp=2", "dp=2,tp=4"),
    ]),
)
def test_import_restore_export_gives_the_reference(tmp_path, family, opts, mesh_a, mesh_b):
    ref = _ref(family, seed=7)
    src = str(tmp_path / "megatron")
    write_megatron(src, ref, iteration=41, **opts)
    opened = open_source(src)
    assert opened.config == models.config_from_hf(ref.config)
    assert opened.config.family == family
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    # with 16-bit weights the fp32 master weights are what gets imported: the reference itself
    assert_same(params, ref.weights)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == 41


@pytest.mark.parametrize("family, tied", [("qwen2", False), ("qwen3", True)])
def test_logits_equal_transformers_on_the_reference(tmp_path, family, tied):
    """Megatron tp2 pp2 -> our logits equal transformers' forward on the unsplit reference; the
    weights the family adds matter (biases zeroed, q/k norm weights set to 1: far off)."""
    ref = _ref(family, seed=9, tied=tied)
    write_megatron(str(tmp_path), ref, tp=2, pp=2)
    cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in ref.config.items() if k != "architectures"}
    )
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert type(model).__name__ == ref.config["architectures"][0]
    state = {k: torch.from_numpy(v) for k, v in ref.weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing) and tied == bool(missing)
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path), tokens, mesh=fit("fsdp=2,tp=2,pp=2"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    plain = {k: v for k, v in ref.weights.items() if not k.endswith(("_proj.bias", "_norm.weight"))}
    assert len(plain) < len(ref.weights)
    with torch.no_grad():
        for k in set(ref.weights) - set(plain):
            model.get_parameter(k).fill_(0.0 if k.endswith("bias") else 1.0)
        without = model(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.abs(without - want).max() > 1000 * 1e-4


def test_args_choose_the_family(tmp_path):
    """Llama's layout with q/k/v biases is Qwen2, with q/k norms Qwen3; all linear biases with
    SwiGLU and RMSNorm is none of the known families and is refused naming them."""
    for family in ("qwen2", "qwen3"):
        write_megatron(str(tmp_path / family), _ref(family, seed=1), tp=1, pp=1)
        cfg = open_source(str(tmp_path / family)).config
        assert cfg.family == family and cfg.head_dim == (12 if family == "qwen3" else 8)
    f = tmp_path / "qwen2" / "iter_0000120" / "mp_rank_00" / "model_optim_rng.pt"
    st = torch.load(f, weights_only=False)
    st["args"].add_bias_linear = True
    torch.save(st, f)
    with pytest.raises(
        FormatError, match=r"qkv_bias=True, linear_bias=True.*nor Qwen2 \(.*qkv_bias=True"
    ):
        open_source(str(tmp_path / "qwen2"))
    with pytest.raises(ValueError, match="no --qk-layernorm"):
        write_megatron(str(tmp_path / "legacy"), _ref("qwen3", seed=1), keys="legacy")
