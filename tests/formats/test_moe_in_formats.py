"""MoE models of transformers 5 saved by the formats that carry any model under its own names.

transformers 5 holds an MoE layer's experts fused in memory (`mlp.experts.gate_up_proj`
[experts, 2*moe_ffn, hidden] with each expert's rows `[gate | up]`, `mlp.experts.down_proj`
[experts, hidden, moe_ffn]; transformers/conversion_mapping.py) and converts to the Hub's
per-expert names only in `save_pretrained`. A torch DCP save of an FSDP2 run of such a model carries
the fused names (so would a DeepSpeed ZeRO-3 save; its reference gather,
`safe_get_full_fp32_param`, fails on transformers 5's fused expert params in DeepSpeed 0.19.8). The family's name fixes (`models.hf_name_fixes`)
apply after any format's rules (`naming.source_to_hf`), so these import like the Hub's files.

Written in the test session by the real tool (torch's `dcp.save` after 3 AdamW steps under
`fully_shard` over 2 gloo ranks). Checks: logits after import onto a mesh that splits the experts over dp equal
transformers' forward of the unsplit model (fp32, 1e-4); import -> restore on another mesh ->
export gives torch's params and moments back bit for bit, under the Hub's per-expert names.
"""

from __future__ import annotations

import os

import numpy as np
import transformers
from e2e import assert_same, roundtrip
from fixtures import FIXTURES
from fixtures.torch_common import load_reference, reference_names
from meshes import fit_pair
from test_families_in_formats import TOKENS, _transformers_logits, _write

from hybridckpt import jobs
from hybridckpt.formats.registry import detect, open_source

MOE_FFN = 8


def _qwen3_moe():
    return transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=MOE_FFN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _per_expert(fused: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers 5's fused expert tensors under the Hub's per-expert names (the reference for
    what the export writes): gate_up_proj[e] = [gate_e | up_e] rows, down_proj[e] = down_e."""
    out = {}
    for k, v in fused.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :MOE_FFN]
                out[f"{pre}{e}.up_proj.weight"] = v[e, MOE_FFN:]
        elif k.endswith(".mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def _check(path: str, ref, tmp_path, *, mesh_a: str, mesh_b: str) -> None:
    mesh_a, mesh_b = fit_pair(mesh_a, mesh_b, keep="dp")
    weights = {k: ref[f"param/{k}"] for k in reference_names(ref, "param")}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in weights)  # fused, as saved
    src = open_source(path)
    assert src.config.family == "qwen3_moe"
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in src.tensors)
    got = jobs.logits(path, TOKENS, mesh=mesh_a)
    want = _transformers_logits(_qwen3_moe(), weights)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    params, mu, nu, step = roundtrip(path, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, _per_expert(weights))
    assert_same(mu, _per_expert({k: ref[f"exp_avg/{k}"] for k in weights}), "exp_avg")
    assert_same(nu, _per_expert({k: ref[f"exp_avg_sq/{k}"] for k in weights}), "exp_avg_sq")
    assert step == 3


def test_fused_experts_matter():
    """The split of gate_up_proj matters: gate and up swapped in every expert moves the logits far
    beyond the tolerance (so the per-expert split above is checked, not assumed)."""
    cfg = _qwen3_moe()
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    weights = {k: v.detach().numpy() + 0.0 for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    weights = {k: v + rng.normal(0, 0.05, v.shape).astype(v.dtype) for k, v in weights.items()}
    swapped = dict(weights)
    for k, v in weights.items():
        if k.endswith("gate_up_proj"):
            swapped[k] = np.concatenate([v[:, MOE_FFN:], v[:, :MOE_FFN]], axis=1)
    diff = np.abs(_transformers_logits(cfg, weights) - _transformers_logits(cfg, swapped)).max()
    assert diff > 100 * 1e-4, diff


def test_qwen3_moe_in_dcp(tmp_path):
    """Qwen3-MoE trained 3 steps under FSDP2 on 2 ranks, `dcp.save` of `get_state_dict`."""
    cfg_dir = tmp_path / "config"
    _qwen3_moe().save_pretrained(cfg_dir)
    out = tmp_path / "dcp"
    _write([os.path.join(FIXTURES, "dcp_writer.py"), str(out), str(cfg_dir)])
    path = str(out / "fsdp2")
    assert detect(path) == "dcp"
    ref, _ = load_reference(out, "fsdp2")
    _check(path, ref, tmp_path, mesh_a="dp=2,fsdp=2,tp=2", mesh_b="dp=4,pp=2")
