"""models/qwen2_5_vl: Qwen2.5-VL as released (`Qwen2_5_VLForConditionalGeneration`) against
transformers' own model.

Tiny wrappers built by transformers (every parameter random, `hf_parity.build`) and saved by its
`save_pretrained` in this session under both spellings transformers 5.24 writes: the default
(`model.*`, `visual.*`, the released files' names) and `save_original_format=False`
(`model.language_model.*`, `model.visual.*`); one ties its head through its text config
(Qwen2.5-VL-3B).

Checked: the text model's logits (fp32, atol 1e-4, pp=2 and tp) against the wrapper's own
forward with no image; with 3-axis position ids against transformers' given the same (chunked
M-RoPE; the interleaved layout of Qwen3-VL is far off); import -> restore -> export bitwise, the
tower included, loaded back by transformers; the released flat config.json (text keys at the
top level, `rope_scaling.type: "mrope"`) read as transformers reads it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_parity import (
    TOKENS,
    assert_far,
    assert_logits,
    build,
    read_params,
    roundtrip_bitwise,
    torch_logits,
)

from hybridckpt import jobs, models
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen2_5_vl.config import Qwen2_5_VLConfig

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})  # fmt: skip
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, out_hidden_size=32,
              fullatt_block_indexes=[1], window_size=8)  # fmt: skip
MODELS = {
    "hf_names": (dict(text_config=TEXT, vision_config=VISION), True),
    "module_names_tied": (dict(text_config=dict(TEXT, tie_word_embeddings=True), vision_config=VISION), False),
}  # fmt: skip
POSITIONS = np.random.default_rng(1).integers(0, 24, (3, *TOKENS.shape))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for seed, (name, (kwargs, original)) in enumerate(MODELS.items()):
        m = build("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", kwargs, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder, save_original_format=original)
        out[name] = (str(folder), m)
    return out


def _names(folder: str) -> list[str]:
    return sorted(jobs.open_checkpoint(folder).named.params)


def _torch_logits_at(m, positions: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return m(
            torch.tensor(TOKENS, dtype=torch.long), position_ids=torch.tensor(positions)
        ).logits.numpy()


def test_the_fixtures_use_both_spellings(hf_dirs):
    a, b = _names(hf_dirs["hf_names"][0]), _names(hf_dirs["module_names_tied"][0])
    assert (
        "model.embed_tokens.weight" in a
        and "visual.merger.mlp.2.weight" in a
        and "lm_head.weight" in a
    )
    assert (
        "model.language_model.layers.0.self_attn.q_proj.bias" in b
        and "model.visual.blocks.1.norm2.weight" in b
    )
    assert "lm_head.weight" not in b


@pytest.mark.parametrize("name", MODELS)
def test_text_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    cfg = jobs.open_checkpoint(folder).config
    assert type(cfg) is Qwen2_5_VLConfig and cfg.tie_word_embeddings == (
        name == "module_names_tied"
    )
    assert_logits(folder, torch_logits(m))


def test_three_axis_positions_equal_transformers_and_the_chunking_matters(hf_dirs, monkeypatch):
    folder, m = hf_dirs["hf_names"]
    cfg, params = read_params(folder)

    def ours():
        return np.asarray(
            jax.jit(lambda p: models.module(cfg).apply({"params": p}, TOKENS, POSITIONS))(params)
        )

    want = _torch_logits_at(m, POSITIONS)
    assert_far(want, torch_logits(m))
    np.testing.assert_allclose(ours(), want, atol=1e-4, rtol=0)
    monkeypatch.setattr(Qwen2_5_VLConfig, "mrope_interleaved", property(lambda self: True))
    assert_far(ours(), want)


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    assert _names(out) == _names(folder)
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert back.config.text_config.rope_parameters["mrope_section"] == [1, 1, 2]
    np.testing.assert_array_equal(_torch_logits_at(back, POSITIONS), _torch_logits_at(m, POSITIONS))


def test_the_released_flat_config_reads_as_transformers_reads_it():
    """Qwen2.5-VL's released config.json: text keys at the top level, `rope_scaling` of type
    "mrope" (rope type default for transformers), tied through `tie_word_embeddings`."""
    d = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "vocab_size": 96,
         "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rope_theta": 1000000.0, "max_window_layers": 28, "use_sliding_window": False,
         "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}, "tie_word_embeddings": True,
         "vision_config": {"depth": 2, "hidden_size": 16, "out_hidden_size": 32}}  # fmt: skip
    cfg = models.config_from_hf(d)
    theirs = transformers.Qwen2_5_VLConfig(**{k: v for k, v in d.items() if k != "architectures"})
    tc = theirs.text_config
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        tc.rope_parameters["rope_theta"], tc.rms_norm_eps, tc.max_position_embeddings)  # fmt: skip
    assert cfg.rope_scaling is None and cfg.mrope_section == (1, 1, 2)
    assert cfg.tie_word_embeddings is theirs.tie_word_embeddings is True
    assert (cfg.vision_depth, cfg.vision_intermediate_size, cfg.vision_merged_size) == (2, 3420, 64)
    back = models.config_to_hf(cfg)
    assert (
        models.config_from_hf(back) == cfg
        and back["text_config"]["model_type"] == "qwen2_5_vl_text"
    )
    again = transformers.Qwen2_5_VLConfig(**{k: v for k, v in back.items() if k != "architectures"})
    assert again.text_config.rope_parameters == {
        k: v for k, v in tc.rope_parameters.items() if k != "type"
    }
    with pytest.raises(
        ConfigError,
        match=r"c.json: .*mrope_section \[1, 1, 1\] sums to 3; expected head_dim / 2 = 4",
    ):
        models.config_from_hf(
            {**d, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 1]}}, source="c.json"
        )
