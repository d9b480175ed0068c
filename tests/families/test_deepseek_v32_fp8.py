"""An FP8 block-quantized DeepSeek V3.2 (DeepSeek's release layout) dequantized on import.

The tiny model of `test_deepseek_v32` (transformers 5.24's DeepseekV32ForCausalLM, its MTP
module left out) with every Linear weight of the decoder layers quantized as DeepSeek's releases
store them: `X.weight` float8_e4m3fn `[out, in]` and `X.weight_scale_inv` float32
`[ceil(out / 16), ceil(in / 16)]` (amax / 448 per block, the grid anchored at 0; blocks of 16 for
the tiny sizes where the releases have 128: most weights here have partial edge blocks, as
`kv_a_proj_with_mqa` 576 x 7168 has in 128-blocks), the indexer's `wq_b` and `wk` included;
the router, norms, embedding, head and `indexer.weights_proj` unquantized (weights_proj fp32
beside bf16 weights). No public tool writes this layout (transformers' quantizer leaves a weight
whose dims the block does not divide unquantized, and its dequantization infers a block as
`shape // grid`, wrong for partial blocks: `hybridckpt/formats/hf/quant.py`), so the test
quantizes; the reference is DeepSeek's `weight_dequant` (deepseek-ai/DeepSeek-V3:
inference/kernel.py: float32 `q * scale`, stored as bf16), computed here in torch.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from hf_parity import load_fp32
from meshes import fit
from safetensors.torch import load_file, save_file
from test_deepseek_v32 import MESH, SIZES, TOKENS, _build, _torch_logits

from hybridckpt import jobs
from hybridckpt.formats.registry import open_source

BLOCK = 16
UNQUANTIZED = (
    "norm.weight",
    "layernorm.weight",
    "k_norm.bias",
    "mlp.gate.weight",
    "weights_proj.weight",
)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and float32 multipliers per BLOCK x BLOCK block (amax / 448)."""
    m, n = w.shape
    gm, gn = -(-m // BLOCK), -(-n // BLOCK)
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(gm, gn, dtype=torch.float32)
    for i in range(gm):
        for j in range(gn):
            tile = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            s[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (tile / s[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, s


def _weight_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's `weight_dequant` before it stores: float32 q times its block's scale."""
    full = s.repeat_interleave(BLOCK, 0)[: q.shape[0]].repeat_interleave(BLOCK, 1)[:, : q.shape[1]]
    return q.float() * full


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """(the FP8 folder, the same model with DeepSeek's dequantized weights stored as DeepSeek's
    kernel stores them (bf16), the same with their exact float32 values, {name: the dequantized
    weight as bf16})."""
    m = _build(3)
    src = str(tmp_path_factory.mktemp("src"))
    m.save_pretrained(src)
    saved = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    fp8, deq, plain, exact = {}, {}, {}, {}
    for k, t in saved.items():
        if k.startswith("model.layers.") and t.ndim == 2 and not k.endswith(UNQUANTIZED):
            q, s = _quantize(t)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            exact[k] = _weight_dequant(q, s)
            deq[k] = plain[k] = exact[k].to(torch.bfloat16)
        else:
            keep = k.endswith(("weights_proj.weight", "e_score_correction_bias", "mlp.gate.weight"))
            fp8[k] = plain[k] = exact[k] = t if keep else t.to(torch.bfloat16)
    folders = []
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    for name, tensors, cfg in (
        ("fp8", fp8, {**config, "quantization_config": qc}),
        ("deq", plain, config),
        ("exact", exact, config),
    ):
        folder = str(tmp_path_factory.mktemp(name))
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**cfg, "dtype": "bfloat16"}, f)
        folders.append(folder)
    return (*folders, deq)


def test_fp8_weights_read_as_deepseeks_weight_dequant(fp8_dirs):
    """Each quantized weight (the indexer's wq_b and wk too, partial edge blocks) reads as
    DeepSeek's dequantization, bf16 bit for bit; the unquantized ones in their stored dtype
    (weights_proj fp32)."""
    fp8, deq_folder, _, deq = fp8_dirs
    got = open_source(fp8).tensors
    want = open_source(deq_folder).tensors
    assert sorted(got) == sorted(want)
    assert (
        "model.layers.1.self_attn.indexer.wq_b.weight" in deq
        and "model.layers.3.self_attn.indexer.wk.weight" in deq
    )
    partial = [k for k, t in deq.items() if t.shape[0] % BLOCK or t.shape[1] % BLOCK]
    assert (
        "model.layers.0.self_attn.indexer.wk.weight" in partial
    )  # [12, 32]: rows in one partial block
    for k, t in deq.items():
        a = got[k].materialize()
        assert a.dtype == np.dtype(ml_dtypes.bfloat16), k
        assert np.array_equal(a.view(np.uint16), t.view(torch.int16).numpy().view(np.uint16)), k
    for k in set(got) - set(deq):
        a, b = got[k].materialize(), want[k].materialize()
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), k
    assert (
        got["model.layers.0.self_attn.indexer.weights_proj.weight"].materialize().dtype
        == np.float32
    )


def test_fp8_logits_equal_transformers_on_the_dequantized_weights(fp8_dirs):
    """Our forward of the FP8 folder (on a tp and pp mesh; `logits` computes from the exact float32
    dequantized values, `jobs.logits`) equals transformers' forward of the same model holding
    those values (fp32)."""
    fp8, _, exact, _ = fp8_dirs
    ref = load_fp32(exact)
    assert (
        type(ref) is transformers.DeepseekV32ForCausalLM
        and ref.config.index_topk == SIZES["index_topk"]
    )
    np.testing.assert_allclose(
        jobs.logits(fp8, TOKENS, mesh=fit(MESH)), _torch_logits(ref), atol=1e-4, rtol=0
    )
