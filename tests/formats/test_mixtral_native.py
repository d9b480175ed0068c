"""Mistral's native Mixtral, `params.json` (with `moe`) + `consolidated.safetensors`
(mistralai/mistral-inference transformer_layers.py: `layers.N.feed_forward.gate.weight`,
`layers.N.feed_forward.experts.E.{w1,w2,w3}.weight`), read by the meta-llama format.

The fixture is transformers' own MixtralForCausalLM (every parameter random, routers with a wide
spread), written back to Mistral's layout by the inverse of transformers' converter
(convert_mistral_weights_to_hf.py STATE_DICT_MAPPING, q/k rows un-permuted to interleaved RoPE
pairs). Logits equal transformers' forward (fp32, atol 1e-4) on meshes splitting the experts;
the export is the HF per-expert checkpoint transformers itself saves, bit for bit.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers
from fixtures.hf_moe import hf_state, randomize
from meshes import cases, fit
from safetensors.torch import save_file
from test_mistral_native import unpermute_for_rope

from hybridckpt import jobs, naming
from hybridckpt.errors import UnknownModelError
from hybridckpt.formats import meta_llama
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.io.byte_source import count_reads
from hybridckpt.models.mixtral.config import MixtralConfig

TOKENS = np.random.default_rng(3).integers(0, 96, (2, 12), dtype=np.int32)
CONFIG = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)  # fmt: skip
_NAMES = {  # HF -> Mistral (the inverse of the converter's STATE_DICT_MAPPING)
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "block_sparse_moe.gate.weight": "feed_forward.gate.weight",
}
_TOP = {"lm_head.weight": "output.weight", "model.norm.weight": "norm.weight",
        "model.embed_tokens.weight": "tok_embeddings.weight"}  # fmt: skip


def mistral_state(m) -> dict[str, torch.Tensor]:
    c = m.config
    out = {}
    for k, a in hf_state("mixtral", m).items():
        t = torch.from_numpy(a)
        if k in _TOP:
            name = _TOP[k]
        else:
            _, _, i, rest = k.split(".", 3)
            name = f"layers.{i}." + _NAMES.get(rest, rest.replace("block_sparse_moe.", "feed_forward."))
        if "q_proj" in k:
            t = unpermute_for_rope(t, c.num_attention_heads)
        elif "k_proj" in k:
            t = unpermute_for_rope(t, c.num_key_value_heads)
        out[name] = t.contiguous().clone()
    return out


def mistral_params(m) -> dict:
    """params.json as mistral-inference's TransformerArgs spells it, with MoeArgs."""
    c = m.config
    return {
        "dim": c.hidden_size, "n_layers": c.num_hidden_layers, "head_dim": c.head_dim,
        "hidden_dim": c.intermediate_size, "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads, "norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "rope_theta": 1e6, "moe": {"num_experts": c.num_local_experts, "num_experts_per_tok": c.num_experts_per_tok},
    }  # fmt: skip


def write_mixtral(folder, m, params=None) -> str:
    os.makedirs(folder, exist_ok=True)
    save_file(mistral_state(m), os.path.join(folder, "consolidated.safetensors"))
    with open(os.path.join(folder, "params.json"), "w") as f:
        json.dump(params or mistral_params(m), f)
    return str(folder)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    cfg = transformers.MixtralConfig(**CONFIG, attn_implementation="eager")
    m = randomize(transformers.MixtralForCausalLM(cfg), 7)
    hf = tmp_path_factory.mktemp("hf")
    m.save_pretrained(hf)
    return write_mixtral(tmp_path_factory.mktemp("native"), m), m, str(hf)


def _torch_logits(m) -> np.ndarray:
    with torch.no_grad():
        return m(torch.from_numpy(TOKENS).long()).logits.numpy()


def test_names_are_mistral_inferences(written):
    folder, _, _ = written
    names = set(open_source(folder).tensors)
    assert "layers.1.feed_forward.experts.3.w2.weight" in names and "layers.0.feed_forward.gate.weight" in names
    assert not any("block_sparse_moe" in n for n in names)


@pytest.mark.parametrize("mesh", cases(["dp=2,fsdp=2,tp=2", "dp=4,pp=2"], keep="dp"))
def test_logits_equal_transformers(written, mesh):
    folder, m, _ = written
    assert detect(folder) == "meta-llama"
    cfg = meta_llama.open(folder).config
    assert type(cfg) is MixtralConfig and (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=1e-4, rtol=0)


def test_hf_names_exact_and_export_is_transformers_own_checkpoint(written, tmp_path):
    folder, _, hf_folder = written
    src = meta_llama.open(folder)
    hf = naming.source_to_hf(src, src.config)
    want = {k: v.materialize() for k, v in open_source(hf_folder).tensors.items()}
    assert sorted(hf.params) == sorted(want)
    for k, t in hf.params.items():
        assert np.array_equal(t.materialize(), want[k]), k
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    with count_reads() as c:
        jobs.import_checkpoint(folder, ckpt, mesh=fit("dp=2,fsdp=2,tp=2", keep="dp"))
    st = os.path.join(folder, "consolidated.safetensors")
    assert c[st] == os.path.getsize(st)  # the header once, every expert's bytes once
    jobs.export_checkpoint(ckpt, out)
    got = {k: v.materialize() for k, v in open_source(out).tensors.items()}
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert np.array_equal(got[k].view(np.uint8), w.view(np.uint8)), k
    rows, only_a, only_b = jobs.verify(folder, hf_folder)  # native vs transformers', by HF names
    assert rows and all(r.ok for r in rows) and not only_a and not only_b


@pytest.mark.parametrize("moe", [{"num_experts": 4, "num_experts_per_tok": 2, "gating": "sigmoid"}, [4, 2]])
def test_moe_args_beyond_mixtrals_are_refused(written, tmp_path, moe):
    _, m, _ = written
    folder = write_mixtral(tmp_path / "bad", m, params=mistral_params(m) | {"moe": moe})
    with pytest.raises(UnknownModelError, match=r"params.json: 'moe'.*MoeArgs"):
        meta_llama.open(folder)
