"""Mistral's native layout, `params.json` + `consolidated.safetensors` (mistralai/mistral-inference
`Transformer.from_folder`), read by the meta-llama format as a MistralConfig.

The fixtures are transformers' own MistralForCausalLM (every parameter drawn at random), written
back to Mistral's layout by the inverse of transformers' converter
(huggingface/transformers:src/transformers/models/mistral/convert_mistral_weights_to_hf.py:
`STATE_DICT_MAPPING` names, `permute_for_rope` of q and k undone) with the params.json keys
`convert_config` reads. Logits are compared with transformers' forward pass (fp32, atol 1e-4).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers
from meshes import cases
from safetensors.torch import save_file

from hybridckpt import jobs, naming
from hybridckpt.errors import ConfigError, FormatError, UnknownModelError
from hybridckpt.formats import meta_llama
from hybridckpt.formats.registry import detect
from hybridckpt.models.mistral.config import MistralConfig

TOKENS = np.random.default_rng(2).integers(0, 96, (2, 12), dtype=np.int32)
SIZES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
# window 5 < 12 tokens: it changes attention; head_dim 12: heads * head_dim != hidden (NeMo style)
MODELS = {
    "windowed_nemo": {"sliding_window": 5, "head_dim": 12, "rope_theta": 20000.0},
    "no_window": {"sliding_window": None, "rope_theta": 1e6},
}
_NAMES = {  # HF -> Mistral (the inverse of the converter's STATE_DICT_MAPPING)
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
_TOP = {"lm_head.weight": "output.weight", "model.norm.weight": "norm.weight",
        "model.embed_tokens.weight": "tok_embeddings.weight"}  # fmt: skip


def _build(name: str, seed: int) -> transformers.MistralForCausalLM:
    cfg = transformers.MistralConfig(**SIZES, **MODELS[name], attn_implementation="eager")
    m = transformers.MistralForCausalLM(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            p.normal_(1.0 if pname.endswith("norm.weight") else 0.0, 0.15 if p.ndim > 1 else 0.3)
    return m


def unpermute_for_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of the converter's `permute_for_rope` (`view(heads, rows/heads/2, 2, dim)
    .transpose(1, 2)`): HF half-split rows back to Mistral's interleaved pairs."""
    rows, dim = w.shape
    return w.view(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def mistral_state(m) -> dict[str, torch.Tensor]:
    c = m.config
    out = {}
    for k, t in m.state_dict().items():
        if k in _TOP:
            name = _TOP[k]
        else:
            _, _, i, rest = k.split(".", 3)
            name = f"layers.{i}.{_NAMES[rest]}"
        if "q_proj" in k:
            t = unpermute_for_rope(t, c.num_attention_heads)
        elif "k_proj" in k:
            t = unpermute_for_rope(t, c.num_key_value_heads)
        out[name] = t.contiguous().clone()
    return out


def mistral_params(m, **extra) -> dict:
    """params.json as mistral-inference's `TransformerArgs` (args.py) spells it."""
    c = m.config
    p = {
        "dim": c.hidden_size, "n_layers": c.num_hidden_layers, "head_dim": c.head_dim,
        "hidden_dim": c.intermediate_size, "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads, "norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "rope_theta": c.rope_parameters["rope_theta"], "sliding_window": c.sliding_window,
    }  # fmt: skip
    return p | extra


def write_mistral(folder, m, *, params=None, dtype=torch.float32) -> str:
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.to(dtype) for k, v in mistral_state(m).items()}, os.path.join(folder, "consolidated.safetensors"))
    with open(os.path.join(folder, "params.json"), "w") as f:
        json.dump(params if params is not None else mistral_params(m), f)
    return str(folder)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = {}
    for seed, name in enumerate(MODELS):
        m = _build(name, seed)
        out[name] = (write_mistral(tmp_path_factory.mktemp(name), m), m)
    return out


def _torch_logits(m) -> np.ndarray:
    with torch.no_grad():
        return m(torch.from_numpy(TOKENS).long()).logits.numpy()


@pytest.mark.parametrize("name, mesh", cases([("windowed_nemo", "fsdp=2,tp=2,pp=2"), ("no_window", "tp=4,pp=2")]))
def test_logits_equal_transformers(written, name, mesh):
    folder, m = written[name]
    assert detect(folder) == "meta-llama"
    src = meta_llama.open(folder)
    cfg = src.config
    assert isinstance(cfg, MistralConfig) and not cfg.tie_word_embeddings
    assert (cfg.sliding_window, cfg.head_dim, cfg.rope_theta) == (
        m.config.sliding_window, m.config.head_dim, m.config.rope_parameters["rope_theta"]
    )
    np.testing.assert_allclose(jobs.logits(folder, TOKENS, mesh=mesh), _torch_logits(m), atol=1e-4, rtol=0)


def test_weights_exact_under_hf_names_and_rope_rows_permuted(written):
    folder, m = written["windowed_nemo"]
    src = meta_llama.open(folder)
    hf = naming.source_to_hf(src, src.config)
    want = m.state_dict()
    assert sorted(hf.params) == sorted(want)
    for k, t in hf.params.items():
        assert np.array_equal(t.materialize(), want[k].numpy()), k
    wq = src.tensors["layers.0.attention.wq.weight"].materialize()
    assert not np.array_equal(wq, want["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_bf16_weights_come_through_bit_for_bit(written, tmp_path):
    """Mistral ships bf16: the tensors keep their dtype and bits."""
    _, m = written["no_window"]
    folder = write_mistral(tmp_path / "bf16", m, dtype=torch.bfloat16)
    src = meta_llama.open(folder)
    hf = naming.source_to_hf(src, src.config)
    for k, v in m.state_dict().items():
        got = hf.params[k].materialize()
        assert str(got.dtype) == "bfloat16"
        assert np.array_equal(got.view(np.uint16), v.bfloat16().view(torch.uint16).numpy()), k


@pytest.mark.parametrize(
    "extra, want",
    [
        ({"sliding_window": "5"}, (5, 1e4)),  # a string (convert_config); no rope_theta: 1e4
        ({"sliding_window": None}, (None, 1e6)),  # no window, no rope_theta: 1e6
        ({"_sliding_window": [7, 7]}, (7, 1e4)),  # the vLLM spelling, one window per layer
    ],
)
def test_params_json_variants(written, tmp_path, extra, want):
    _, m = written["windowed_nemo"]
    params = {k: v for k, v in mistral_params(m).items() if k not in ("sliding_window", "rope_theta")}
    folder = write_mistral(tmp_path / "v", m, params=params | extra)
    cfg = meta_llama.open(folder).config
    assert (cfg.sliding_window, cfg.rope_theta) == want
    assert cfg.max_position_embeddings == 32768  # convert_config's default without max_seq_len


@pytest.mark.parametrize(
    "extra, error, words",
    [
        ({"vision_encoder": {"hidden_size": 8}}, UnknownModelError, "Pixtral"),
        ({"sliding_window": [4, 8]}, UnknownModelError, "differs between layers"),
        ({"sliding_window": "wide"}, ConfigError, "not an integer"),
    ],
)
def test_what_no_family_implements_is_refused(written, tmp_path, extra, error, words):
    _, m = written["windowed_nemo"]
    folder = write_mistral(tmp_path / "bad", m, params=mistral_params(m, **extra))
    with pytest.raises(error) as e:
        meta_llama.open(folder)
    assert words in str(e.value) and "params.json" in str(e.value)


def test_pth_beside_safetensors_is_refused(written, tmp_path):
    folder, _ = written["no_window"]
    import shutil

    both = tmp_path / "both"
    shutil.copytree(folder, both)
    torch.save({}, both / "consolidated.00.pth")
    with pytest.raises(FormatError, match="both consolidated.safetensors and consolidated.NN.pth"):
        meta_llama.open(str(both))


def test_mistral_params_with_a_pth_file(written, tmp_path):
    """Mistral 7B v0.1 shipped `consolidated.00.pth` with the same params.json: hidden_dim and
    the window are read from it (Meta's multiple_of rule would give another FFN width)."""
    _, m = written["windowed_nemo"]
    folder = tmp_path / "pth"
    os.makedirs(folder)
    torch.save(mistral_state(m), folder / "consolidated.00.pth")
    with open(folder / "params.json", "w") as f:
        json.dump(mistral_params(m), f)
    src = meta_llama.open(str(folder))
    assert isinstance(src.config, MistralConfig) and src.config.intermediate_size == 64
    hf = naming.source_to_hf(src, src.config)
    for k, v in m.state_dict().items():
        assert np.array_equal(hf.params[k].materialize(), v.numpy()), k
