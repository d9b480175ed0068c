"""Megatron-LM legacy checkpoints with RoPE scaling in their args (issue 13).

`--use-rope-scaling --rope-scaling-factor F` is Llama 3.x's scaling with Megatron's fixed
constants (low 1, high 4, original context 8192: NVIDIA/Megatron-LM
megatron/core/models/common/embeddings/rotary_pos_embedding.py `_apply_scaling`);
`--rotary-seq-len-interpolation-factor F` is linear scaling. Fixtures by
tests/fixtures/megatron_writer.py from a reference whose HF config carries that `rope_scaling`;
our logits of the Megatron checkpoint equal transformers' LlamaForCausalLM with the same
`rope_scaling` (fp32, 1e-4), and differ far more than that without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from fixtures.megatron_writer import make_llama, write_megatron
from meshes import fit

from hybridckpt import jobs, models
from hybridckpt.errors import FormatError
from hybridckpt.formats.megatron.config import hf_config
from hybridckpt.formats.registry import open_source

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LINEAR = {"rope_type": "linear", "factor": 4.0}
# head_dim 16 at theta 500000: wavelengths 6 .. 660k positions, on both sides of Llama 3's
# 2048 / 8192 bounds, so the scaling changes low and medium frequencies
TOKENS = np.random.default_rng(4).integers(0, 100, (1, 40)).astype(np.int32)


def _ref(scaling: dict | None):
    ref = make_llama(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=100, seed=5)
    ref.config["rope_theta"] = 500000.0
    if scaling is not None:
        ref.config["rope_scaling"] = dict(scaling)
    return ref


def _transformers_logits(config: dict, weights) -> np.ndarray:
    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.numpy()


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_rope_scaling_args_give_transformers_logits(tmp_path, scaling):
    ref = _ref(scaling)
    write_megatron(str(tmp_path), ref, tp=2, pp=2)
    src = open_source(str(tmp_path))
    assert src.config == models.config_from_hf(ref.config)
    want = _transformers_logits(ref.config, ref.weights)
    got = jobs.logits(str(tmp_path), TOKENS, mesh=fit("fsdp=2,tp=2,pp=2"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    plain = _transformers_logits(_ref(None).config, ref.weights)
    assert np.abs(plain - want).max() > 100 * 1e-4  # the scaling matters here


def test_args_rope_scaling():
    from argparse import Namespace

    base = dict(
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope", hidden_size=64,
        num_attention_heads=4, num_layers=2, ffn_hidden_size=96, vocab_size=100,
        padded_vocab_size=128,
    )
    assert "rope_scaling" not in hf_config(Namespace(**base, use_rope_scaling=False), None, "x")
    cfg = hf_config(Namespace(**base, use_rope_scaling=True), None, "x")  # Megatron's default 8.0
    assert cfg["rope_scaling"] == LLAMA3
    both = Namespace(**base, use_rope_scaling=True, rotary_seq_len_interpolation_factor=2)
    with pytest.raises(FormatError, match="both"):
        hf_config(both, None, "x")
