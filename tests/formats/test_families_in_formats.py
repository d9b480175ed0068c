"""The new families in the formats that carry any model under HF names (issue 13): a Qwen3 in torch
DCP (FSDP2 over 2 gloo ranks), a Gemma 2 in DeepSpeed ZeRO-3, a Mistral in ColossalAI's
distributed format.

Each checkpoint is written in the test session by the real tool (torch's `dcp.save`, DeepSpeed's
`engine.save_checkpoint` after 3 AdamW steps; Colossal's layout by tests/fixtures/colossal_writer.py)
from transformers' own model of that family (`perturbed_model`). Checks: our logits after import
onto `fsdp=2,tp=2,pp=2` equal transformers' forward of the unsplit model (fp32, 1e-4), and
import -> Orbax -> restore on another mesh -> export gives the params (and the moments, where the
format carries them) back bit for bit. The readers need no family knowledge: names are HF's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch
import transformers
from e2e import assert_same, roundtrip
from fixtures import FIXTURES
from fixtures import colossal_writer as cw
from fixtures.torch_common import load_reference, perturbed_model, reference_names
from meshes import fit

from hybridckpt import jobs
from hybridckpt.formats.registry import detect, open_source

# every dim divides by tp=2 and the 2 layers by pp=2
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


def _qwen3():
    # explicit head_dim: heads * head_dim = 48 != hidden 32
    return transformers.Qwen3Config(**SMALL, head_dim=12, tie_word_embeddings=False)


def _gemma2():
    # window 4 < the 11 tokens: the sliding layer differs from the global one
    return transformers.Gemma2Config(
        **SMALL, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, tie_word_embeddings=True
    )


def _mistral():
    return transformers.MistralConfig(**SMALL, sliding_window=4, tie_word_embeddings=False)


def _write(cmd: list[str], env=None) -> None:
    res = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")


def _transformers_logits(config, weights: dict[str, np.ndarray]) -> np.ndarray:
    """transformers' forward (eager, fp32) of the unsplit `weights` on TOKENS."""
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.numpy()


def _check_logits(path: str, config, weights) -> None:
    got = jobs.logits(path, TOKENS, mesh=fit("fsdp=2,tp=2,pp=2"))
    np.testing.assert_allclose(got, _transformers_logits(config, weights), atol=1e-4, rtol=0)


def _trained_roundtrip(path: str, tmp_path, ref, *, mesh_b: str) -> None:
    """import onto fsdp=2,tp=2,pp=2 -> restore on `mesh_b` -> export: torch's gathered params and
    moments bit for bit, the step too."""
    weights = {k: ref[f"param/{k}"] for k in reference_names(ref, "param")}
    params, mu, nu, step = roundtrip(path, str(tmp_path), mesh_a="fsdp=2,tp=2,pp=2", mesh_b=mesh_b)
    assert_same(params, weights)
    assert_same(mu, {k: ref[f"exp_avg/{k}"] for k in weights}, "exp_avg")
    assert_same(nu, {k: ref[f"exp_avg_sq/{k}"] for k in weights}, "exp_avg_sq")
    assert step == 3


def test_qwen3_in_dcp(tmp_path):
    """Qwen3 (q/k norms, explicit head_dim) trained 3 steps under FSDP2 on 2 ranks, `dcp.save`."""
    cfg_dir = tmp_path / "config"
    _qwen3().save_pretrained(cfg_dir)
    out = tmp_path / "dcp"
    _write([os.path.join(FIXTURES, "dcp_writer.py"), str(out), str(cfg_dir)])
    path = str(out / "fsdp2")
    assert detect(path) == "dcp"
    src = open_source(path)
    assert src.config.family == "qwen3"
    ref, _ = load_reference(out, "fsdp2")
    weights = {k: ref[f"param/{k}"] for k in reference_names(ref, "param")}
    assert any(k.endswith("q_norm.weight") for k in weights)
    _check_logits(path, _qwen3(), weights)
    _trained_roundtrip(path, tmp_path, ref, mesh_b="dp=2,tp=4")


def test_gemma2_in_deepspeed_zero3(tmp_path):
    """Gemma 2 (tied, soft-caps, alternating sliding/global layers) trained 3 steps by DeepSpeed
    ZeRO-3 on 3 CPU ranks; DeepSpeed's own forward agrees with transformers' too."""
    cfg_dir = tmp_path / "config"
    _gemma2().save_pretrained(cfg_dir)
    out = tmp_path / "ds"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "DS_BUILD_OPS": "0",
        "DS_WRITER_VARIANTS": "z3_hf",
        "DS_WRITER_HF_CONFIG": str(cfg_dir),
    }
    _write([os.path.join(FIXTURES, "ds_writer.py"), str(out)], env=env)
    path = str(out / "z3_hf")
    assert detect(path) == "deepspeed"
    src = open_source(path)
    assert src.config.family == "gemma2"
    ref, _ = load_reference(out, "z3_hf")
    weights = {k: ref[f"param/{k}"] for k in reference_names(ref, "param")}
    assert "lm_head.weight" not in weights  # tied: one tensor
    got = jobs.logits(path, ref["tokens/tokens"], mesh=fit("fsdp=2,tp=2,pp=2"))
    np.testing.assert_allclose(got, ref["logits/tokens"], atol=1e-4, rtol=0)
    _check_logits(path, _gemma2(), weights)
    _trained_roundtrip(path, tmp_path, ref, mesh_b="tp=4,pp=2")


def test_mistral_in_colossal(tmp_path):
    """Mistral (sliding window) split tp=2 x pp=2 as shardformer saves it (no optimizer state)."""
    cfg = _mistral()
    model = perturbed_model(cfg, seed=3)
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    path = tmp_path / "colossal"
    cw.write_colossal(str(path), weights, layers=2, tp=2, pp=2)
    cfg.save_pretrained(path)
    assert detect(str(path)) == "colossal"
    assert open_source(str(path)).config.family == "mistral"
    _check_logits(str(path), _mistral(), weights)
    params, _, _, _ = roundtrip(
        str(path), str(tmp_path), mesh_a="fsdp=2,tp=2,pp=2", mesh_b="dp=2,fsdp=4", optimizer=False
    )
    assert_same(params, weights)
