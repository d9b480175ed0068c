"""The jobs on Megatron-Core torch_dist checkpoints: Qwen2 (`--add-qkv-bias`) and Qwen3
(`--qk-layernorm`) end to end, and an export that needs no JAX.

Fixtures: tests/fixtures/megatron_dist_writer.py on `make_qwen` references (Llama's layout plus
`linear_qkv.bias`, fused per query group and cut on rows like the weight, or per-head
`q_layernorm`/`k_layernorm` weights replicated over TP: megatron/core/transformer/attention.py).
Checks: import -> Orbax -> restore on another mesh -> export gives the reference back bit for
bit, moments too; our logits equal transformers' forward on the unsplit reference (fp32, 1e-4);
`export --optimizer` of the source in a fresh process loads no JAX, copies stored bytes file to
file and equals the source.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from e2e import assert_same, roundtrip
from fixtures.ckpt_checks import export_in_fresh_process
from fixtures.megatron_dist_writer import write_torch_dist
from fixtures.megatron_writer import make_llama, make_qwen
from meshes import cases, fit

from hybridckpt import jobs, models
from hybridckpt.formats.registry import open_source

SIZES = dict(hidden=64, layers=4, heads=8, kv_heads=4, ffn=96, vocab=100)


@pytest.mark.parametrize(
    "family, opts, mesh_a, mesh_b",
    cases([
        ("qwen2", dict(tp=2, pp=2, optim="dp_reshardable"), "fsdp=2,tp=2,pp=2", "tp=4,pp=2"),
        (
            "qwen3",
            dict(tp=2, pp=2, vpp=2, optim="fully_reshardable", tied=True),
            "tp=4,pp=2",
            "dp=2,tp=4",
        ),
    ]),
)
def test_roundtrip_and_logits(tmp_path, family, opts, mesh_a, mesh_b):
    tied = opts.pop("tied", False)
    ref = make_qwen(family, **SIZES, tied=tied, seed=3, head_dim=12 if family == "qwen3" else None)
    src = str(tmp_path / "mdist")
    write_torch_dist(src, ref, iteration=41, **opts)
    opened = open_source(src)
    assert opened.config == models.config_from_hf(ref.config) and opened.config.family == family
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, ref.weights)
    assert_same(mu, ref.exp_avg, "exp_avg")
    assert_same(nu, ref.exp_avg_sq, "exp_avg_sq")
    assert step == 41

    cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in ref.config.items() if k != "architectures"}
    )
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in ref.weights.items()}, strict=False
    )
    assert not unexpected and all(k == "lm_head.weight" for k in missing)
    tokens = np.random.default_rng(2).integers(0, 100, (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(src, tokens, mesh=fit("fsdp=2,pp=2"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_export_without_jax(tmp_path):
    src = str(tmp_path / "mdist")
    write_torch_dist(src, make_llama(**SIZES, seed=4), tp=2, pp=2, optim="dp_reshardable")
    out = export_in_fresh_process(src, str(tmp_path / "out"))
    assert out["equal"] and out["loaded"] == []
    assert out["copied"] > out["bytes"] / 2  # stored runs copied file to file, not read
