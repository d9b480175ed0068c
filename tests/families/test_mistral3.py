"""models/mistral3: Mistral-Small-3.1 / 3.2 as released (`Mistral3ForConditionalGeneration`)
against transformers' own model.

Tiny wrappers built by transformers (every parameter random, `hf_parity.build`) and saved by its
`save_pretrained` in this session under both spellings transformers 5.24 writes: the default
(`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`: the Hub's names), tied
as Mistral3Config's default, and `save_original_format=False` (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.weight`), untied, with the
projector's biases and two vision feature layers. The text model has head_dim 12 != 32 / 4 and
rope theta 1e9, as the releases' 128 != 5120 / 32 and 1e9.

Checked: the text logits (fp32, atol 1e-4, a mesh with pp=2 and tp) against the wrapper's own
forward with no image; rope theta and head tying each shown to matter; which
`tie_word_embeddings` ties (the top-level one, true when absent; a head tensor in the
checkpoint is kept untied, as transformers keeps it); import -> restore -> export bitwise for
every tensor, the Pixtral tower and projector included, under the names read; transformers
loads the export back, its state dict bitwise the original's. No vision forward is implemented.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from hf_parity import (
    assert_far,
    assert_logits,
    build,
    forward,
    read_params,
    roundtrip_bitwise,
    torch_logits,
)

from hybridckpt import jobs, models
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.mistral3.config import Mistral3Config

TEXT = dict(model_type="mistral", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1e9}, sliding_window=None)  # fmt: skip
VISION = dict(model_type="pixtral", hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
              head_dim=8, image_size=16, patch_size=4)  # fmt: skip
# name -> (config kwargs, save_original_format)
MODELS = {
    "hf_names_tied": (dict(text_config=TEXT, vision_config=VISION, image_token_index=95), True),
    "module_names_untied": (dict(text_config=TEXT, vision_config=VISION, image_token_index=95, tie_word_embeddings=False,
                                 multimodal_projector_bias=True, vision_feature_layer=[-1, -2]), False),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, (kwargs, original)) in enumerate(MODELS.items()):
        m = build("Mistral3ForConditionalGeneration", "Mistral3Config", kwargs, seed + 30)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder, save_original_format=original)
        out[name] = (str(folder), m)
    return out


def _names(folder: str) -> list[str]:
    return sorted(jobs.open_checkpoint(folder).named.params)


def test_the_fixtures_use_both_spellings(hf_dirs):
    """What the tool wrote (pinned: the prefixes are read off these names)."""
    a, b = _names(hf_dirs["hf_names_tied"][0]), _names(hf_dirs["module_names_untied"][0])
    assert "language_model.model.embed_tokens.weight" in a and "vision_tower.patch_conv.weight" in a
    assert "multi_modal_projector.patch_merger.merging_layer.weight" in a and not any(
        "lm_head" in n for n in a
    )
    assert (
        "model.language_model.embed_tokens.weight" in b and "model.vision_tower.ln_pre.weight" in b
    )
    assert "lm_head.weight" in b and "model.multi_modal_projector.linear_2.bias" in b


@pytest.mark.parametrize("name", MODELS)
def test_text_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    cfg = jobs.open_checkpoint(folder).config
    assert type(cfg) is Mistral3Config and cfg.tie_word_embeddings == (name == "hf_names_tied")
    assert (cfg.head_dim, cfg.rope_theta, cfg.sliding_window) == (12, 1e9, None)
    assert_logits(folder, torch_logits(m))


def test_rope_theta_and_the_tied_head_matter(hf_dirs):
    """Same params: rope theta 1e4 (Mistral's usual) instead of 1e9, or the tied model's head
    taken as a fresh (zero) matrix: far from transformers'."""
    folder, m = hf_dirs["hf_names_tied"]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    np.testing.assert_allclose(forward(cfg, params), want, atol=1e-4, rtol=0)
    assert_far(forward(dataclasses.replace(cfg, rope_theta=1e4), params), want)
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)
    head = {"lm_head": {"kernel": np.zeros_like(params["embed"]["embedding"].T)}}
    assert_far(forward(untied, params | head), want)


def test_the_top_level_key_ties(hf_dirs, tmp_path):
    """transformers 5.24 ties by the top-level `tie_word_embeddings` (true when absent), never by
    the text_config's (false in what it saves); a head tensor present is kept untied, as
    transformers keeps it: our logits equal its on each folder."""
    folder, m = hf_dirs["hf_names_tied"]
    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    assert d["tie_word_embeddings"] is True and d["text_config"]["tie_word_embeddings"] is False
    no_key = {k: v for k, v in d.items() if k != "tie_word_embeddings"}
    assert models.config_from_hf(no_key).tie_word_embeddings
    assert transformers.Mistral3Config(
        **{k: v for k, v in no_key.items() if k != "architectures"}
    ).tie_word_embeddings
    # the untied model's folder with the top-level key removed: transformers keeps its lm_head
    src, um = hf_dirs["module_names_untied"]
    work = tmp_path / "no_key"
    shutil.copytree(src, work)
    with open(work / "config.json") as f:
        ud = json.load(f)
    del ud["tie_word_embeddings"]
    with open(work / "config.json", "w") as f:
        json.dump(ud, f)
    theirs = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        work, dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    assert torch.equal(theirs.lm_head.weight, um.lm_head.weight)
    assert jobs.open_checkpoint(str(work)).config.tie_word_embeddings is False
    assert_logits(str(work), torch_logits(theirs))


def test_the_text_model_is_the_mistral_family(hf_dirs):
    folder, m = hf_dirs["module_names_untied"]
    cfg, params = read_params(folder)
    text_cfg = models.config_from_hf(
        m.config.text_config.to_dict() | {"architectures": ["MistralForCausalLM"]}
    )
    assert models.family_of(text_cfg).name == "mistral"
    text_tree = models.param_shape_tree(text_cfg)
    assert {k: v for k, v in models.param_shape_tree(cfg).items() if k in text_tree} == text_tree
    assert set(params) == {*text_tree, "vision", "projector"}
    sd = m.state_dict()
    assert np.array_equal(params["vision"]["layers"]["up_proj"]["weight"][1],
                          sd["model.vision_tower.transformer.layers.1.feed_forward.up_proj.weight"].numpy())  # fmt: skip
    assert params["projector"]["linear_1"]["weight"].shape == (32, 32)  # two feature layers of 16
    assert np.array_equal(params["projector"]["merging_layer"]["weight"],
                          sd["model.multi_modal_projector.patch_merger.merging_layer.weight"].numpy())  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    assert _names(out) == _names(folder)  # the vision tower and projector under their names
    back = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    for key in ("tie_word_embeddings", "image_token_index", "vision_feature_layer", "multimodal_projector_bias",
                "spatial_merge_size"):  # fmt: skip
        assert getattr(back.config, key) == getattr(m.config, key), key
    assert back.config.text_config.rope_parameters == m.config.text_config.rope_parameters
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_config_read_and_written(hf_dirs):
    folder, _ = hf_dirs["module_names_untied"]
    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    cfg = models.config_from_hf(d)
    assert (cfg.vision_hidden_size, cfg.vision_num_layers, cfg.vision_patch_size, cfg.num_feature_layers,
            cfg.projector_bias) == (16, 2, 4, 2, True)  # fmt: skip
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    back = models.config_to_hf(cfg)
    assert models.config_from_hf(back) == cfg
    assert {k: v for k, v in back.items() if k != "text_config"} == {
        k: v for k, v in d.items() if k != "text_config"
    }
    # sub-configs absent: Mistral3Config's init_kwargs (Mistral-Small-3.1's sizes)
    bare = models.config_from_hf(
        {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3"}
    )
    theirs = transformers.Mistral3Config()
    assert (bare.hidden_size, bare.head_dim, bare.rope_theta, bare.vision_hidden_size, bare.vision_patch_size) == (
        theirs.text_config.hidden_size, theirs.text_config.head_dim, 1e9, theirs.vision_config.hidden_size,
        theirs.vision_config.patch_size)  # fmt: skip
    with pytest.raises(
        ConfigError, match="c.json: text_config.model_type 'llama' is not supported"
    ):
        models.config_from_hf(
            {**d, "text_config": {**d["text_config"], "model_type": "llama"}}, source="c.json"
        )
    with pytest.raises(
        ConfigError, match="c.json: vision_feature_layer: expected an int or a list of ints"
    ):
        models.config_from_hf({**d, "vision_feature_layer": "last"}, source="c.json")
    with pytest.raises(ConfigError, match="text_prefix: 'lm.'; expected one of"):
        models.config_from_dict({**models.config_to_dict(cfg), "text_prefix": "lm."})
