"""models/qwen3_vl: Qwen3-VL as released (`Qwen3VLForConditionalGeneration`) against transformers'
own model.

Tiny wrappers built by transformers (every parameter random, `hf_parity.build`) and saved by its
`save_pretrained` in this session: an untied one with two DeepStack mergers, a tied one
(Qwen3-VL-2B/4B tie) saved with `save_original_format=False`.

Checked: the text model's logits (fp32, atol 1e-4, a mesh with pp=2 and tp=4 or the largest of
that form) against the wrapper's own forward with no image; with 3-axis position ids (M-RoPE,
temporal / height / width apart) against transformers' given the same ids; each part of the
family shown to matter (the interleaved M-RoPE layout, the per-head q/k norms); text-only
positions are plain RoPE (the Qwen3 family's forward on the same text params); import ->
restore -> export bitwise for every tensor, the vision tower and its DeepStack mergers included;
transformers loads the export back, its state dict bitwise the original's; the heads split over
tp on head boundaries, the tower replicated. No vision forward is implemented (the tower is
carried, not run).
"""

from __future__ import annotations

import dataclasses
import json
import os

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
    forward,
    read_params,
    roundtrip_bitwise,
    torch_logits,
)

from hybridckpt import jobs, models, naming
from hybridckpt.errors import MappingError
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen3.config import Qwen3Config
from hybridckpt.models.qwen3_vl.config import Qwen3VLConfig

ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_parameters=ROPE)  # fmt: skip
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1])  # fmt: skip
# name -> (config kwargs, save_original_format)
MODELS = {
    "untied": (dict(text_config=TEXT, vision_config=VISION), True),
    "tied_module_names": (dict(text_config=TEXT, vision_config=dict(VISION, deepstack_visual_indexes=[1]),
                               tie_word_embeddings=True), False),
}  # fmt: skip
# distinct temporal / height / width positions, as an image's tokens have
POSITIONS = np.random.default_rng(0).integers(0, 24, (3, *TOKENS.shape))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, (kwargs, original)) in enumerate(MODELS.items()):
        m = build("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", kwargs, seed)
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


def _ours_at(cfg, params, positions: np.ndarray) -> np.ndarray:
    return np.asarray(
        jax.jit(lambda p: models.module(cfg).apply({"params": p}, TOKENS, positions))(params)
    )


def test_the_fixtures_are_what_transformers_writes(hf_dirs):
    """The names transformers 5.24 writes (pinned: the prefixes are read off them)."""
    a, b = _names(hf_dirs["untied"][0]), _names(hf_dirs["tied_module_names"][0])
    assert "model.language_model.embed_tokens.weight" in a and "lm_head.weight" in a
    assert "model.visual.deepstack_merger_list.1.linear_fc2.weight" in a
    assert "model.visual.patch_embed.proj.weight" in b and "lm_head.weight" not in b


@pytest.mark.parametrize("name", MODELS)
def test_text_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    cfg = jobs.open_checkpoint(folder).config
    assert type(cfg) is Qwen3VLConfig and cfg.mrope_section == (2, 1, 1)
    assert cfg.tie_word_embeddings == (name == "tied_module_names")
    assert_logits(folder, torch_logits(m))


def test_three_axis_positions_equal_transformers_and_the_interleaving_matters(hf_dirs, monkeypatch):
    """With temporal / height / width positions apart, our M-RoPE equals transformers' (which
    interleaves T H W over the frequencies); chunked sections (Qwen2.5-VL's layout) are far off."""
    folder, m = hf_dirs["untied"]
    cfg, params = read_params(folder)
    want = _torch_logits_at(m, POSITIONS)
    assert_far(want, torch_logits(m))  # the positions are not the text ones
    np.testing.assert_allclose(_ours_at(cfg, params, POSITIONS), want, atol=1e-4, rtol=0)
    monkeypatch.setattr(Qwen3VLConfig, "mrope_interleaved", property(lambda self: False))
    assert_far(_ours_at(cfg, params, POSITIONS), want)


def test_text_positions_are_plain_rope_and_qk_norm_matters(hf_dirs, monkeypatch):
    """Text-only positions (none given, or the same ids on three axes) give the Qwen3 family's
    forward on the same text params (plain RoPE); without the per-head q/k norms, far off."""
    folder, m = hf_dirs["untied"]
    cfg, params = read_params(folder)
    want = torch_logits(m)
    text_cfg = Qwen3Config(
        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Qwen3Config)}
    )
    assert models.family_of(text_cfg).name == "qwen3"
    text_params = {k: v for k, v in params.items() if k != "vision"}
    np.testing.assert_allclose(forward(text_cfg, text_params), want, atol=1e-4, rtol=0)
    same = np.broadcast_to(np.arange(TOKENS.shape[1]), (3, *TOKENS.shape))
    np.testing.assert_allclose(_ours_at(cfg, params, same), want, atol=1e-4, rtol=0)
    monkeypatch.setattr(Qwen3VLConfig, "qk_norm", property(lambda self: False))
    assert_far(forward(cfg, params), want)


def test_the_tower_is_carried_replicated_and_heads_split_on_boundaries(hf_dirs):
    folder, m = hf_dirs["untied"]
    cfg, params = read_params(folder)
    sd = m.state_dict()
    assert np.array_equal(params["vision"]["deepstack"]["fc1"]["weight"][1],
                          sd["model.visual.deepstack_merger_list.1.linear_fc1.weight"].numpy())  # fmt: skip
    assert np.array_equal(params["vision"]["blocks"]["qkv"]["weight"][0],
                          sd["model.visual.blocks.0.attn.qkv.weight"].numpy())  # fmt: skip
    axes, groups = models.param_axes_tree(cfg), models.param_groups_tree(cfg)
    assert axes["vision"]["patch"]["weight"] == (None,) * 5
    assert axes["layers"]["q"]["kernel"] == ("layers", "embed", "heads")
    assert groups["layers"]["q"]["kernel"][2] == ("heads", 4)


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    assert _names(out) == _names(folder)
    back = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert back.config.text_config.rope_parameters == m.config.text_config.rope_parameters
    assert (
        back.config.vision_config.deepstack_visual_indexes
        == m.config.vision_config.deepstack_visual_indexes
    )
    np.testing.assert_array_equal(_torch_logits_at(back, POSITIONS), _torch_logits_at(m, POSITIONS))


def test_config_read_and_written(hf_dirs):
    folder, m = hf_dirs["untied"]
    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    cfg = models.config_from_hf(d)
    assert (cfg.vision_depth, cfg.vision_merged_size, cfg.vision_deepstack_layers, cfg.mrope_interleaved_key) == (
        2, 64, (0, 1), True)  # fmt: skip
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    back = models.config_to_hf(cfg)
    assert models.config_from_hf(back) == cfg
    assert {k: v for k, v in back.items() if k != "text_config"} == {
        k: v for k, v in d.items() if k != "text_config"
    }
    with pytest.raises(
        ConfigError, match="c.json: Qwen3VLForConditionalGeneration needs a text_config"
    ):
        models.config_from_hf({**d, "text_config": None}, source="c.json")
    for key, value, found in (
        ("depth", 10**13, "10000000000000"),
        ("deepstack_visual_indexes", "x", "'x'"),
    ):
        hostile = {**d, "vision_config": {**d["vision_config"], key: value}}
        with pytest.raises(ConfigError, match=f"c.json: Qwen3VLConfig.vision_.*found {found}$"):
            models.config_from_hf(hostile, source="c.json")
    bad = {
        **d,
        "text_config": {**d["text_config"], "rope_parameters": {**ROPE, "mrope_section": [2, 1]}},
    }
    with pytest.raises(
        ConfigError, match=r"c.json: .*mrope_section must be three ints >= 0, found \[2, 1\]"
    ):
        models.config_from_hf(bad, source="c.json")


def test_transformers_defaults_fill_a_sparse_text_config():
    """A text_config without rope_theta or head_dim reads as transformers' Qwen3VLTextConfig does
    (rope_theta 5e5, head_dim 128, mrope_section [24, 20, 20]), not Llama's 1e4."""
    d = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
         "text_config": {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "num_key_value_heads": 1}}  # fmt: skip
    cfg = models.config_from_hf(d)
    theirs = transformers.Qwen3VLConfig(
        **{k: v for k, v in d.items() if k != "architectures"}
    ).text_config
    assert (cfg.rope_theta, cfg.head_dim) == (theirs.rope_parameters["rope_theta"], theirs.head_dim)
    assert cfg.mrope_section == (24, 20, 20) and cfg.vision_deepstack_layers == (8, 16, 24)


def test_the_prefixes_matter(hf_dirs):
    """Read with the legacy prefixes, the checkpoint's names map to nothing: one MappingError
    naming them (so `fit_to_hf_names` really chose the prefixes)."""
    folder, _ = hf_dirs["untied"]
    opened = jobs.open_checkpoint(folder)
    assert (opened.config.text_prefix, opened.config.vision_prefix) == (
        "model.language_model.",
        "model.visual.",
    )
    wrong = models.family_of(opened.config).fit_to_hf_names(
        opened.config, {"model.embed_tokens.weight", "visual.patch_embed.proj.weight"})  # fmt: skip
    assert (wrong.text_prefix, wrong.vision_prefix) == ("model.", "visual.")
    with pytest.raises(MappingError, match="model.language_model"):
        naming.hf_to_tree(opened.named, wrong)
    with pytest.raises(ConfigError, match="text_prefix: 'lm.'; expected one of"):
        models.config_from_dict({**models.config_to_dict(opened.config), "text_prefix": "lm."})
