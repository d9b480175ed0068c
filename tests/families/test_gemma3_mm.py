"""models/gemma3_mm: Gemma 3 4B-27B as released (`Gemma3ForConditionalGeneration`) against
transformers' own model.

Tiny wrappers built by transformers (every parameter random, `hf_parity.build`) and saved by its
`save_pretrained` in this session, under both spellings transformers 5.24 writes: the default
(`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`) and
`save_original_format=False` (the module tree's own names, `model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`). One keeps SigLIP's pooling head
(`vision_use_head`, SiglipVisionConfig's default), one has none (Gemma 3's releases).

Checked: the text model's logits (fp32, atol 1e-4, a mesh with pp=2 and tp=4 or the largest of
that form) against the wrapper's own forward with no image (which, unlike Gemma3ForCausalLM,
applies no final logit soft-cap: shown to matter); import -> restore -> export bitwise
for every tensor, the vision tower and projector included, under the names read; transformers
loads the export back, its state dict bitwise the original's. No vision forward is implemented
(the tower is carried, not run): an image's soft tokens are not checked here.
"""

from __future__ import annotations

import json
import os

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

from hybridckpt import jobs, models, naming
from hybridckpt.errors import MappingError
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.gemma3_mm.config import Gemma3MMConfig
from hybridckpt.models.gemma3_mm.module import Gemma3MM

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
            max_position_embeddings=64, final_logit_softcapping=30.0)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
              image_size=8, patch_size=4)  # fmt: skip
WRAPPER = dict(mm_tokens_per_image=1, image_token_index=95, boi_token_index=93, eoi_token_index=94)
# name -> (config kwargs, save_original_format)
MODELS = {
    "hf_names": (dict(WRAPPER, text_config=TEXT, vision_config=VISION), True),
    "module_names_no_pool_head": (
        dict(WRAPPER, text_config=TEXT, vision_config=dict(VISION, vision_use_head=False)), False),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder written by transformers' save_pretrained, its model)."""
    out = {}
    for seed, (name, (kwargs, original)) in enumerate(MODELS.items()):
        m = build("Gemma3ForConditionalGeneration", "Gemma3Config", kwargs, seed)
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder, save_original_format=original)
        out[name] = (str(folder), m)
    return out


def _names(folder: str) -> list[str]:
    return sorted(jobs.open_checkpoint(folder).named.params)


def test_the_fixtures_use_both_spellings(hf_dirs):
    """What the tool wrote (pinned: the prefixes are read off these names)."""
    a, b = _names(hf_dirs["hf_names"][0]), _names(hf_dirs["module_names_no_pool_head"][0])
    assert "language_model.model.embed_tokens.weight" in a and "vision_tower.head.probe" in a
    assert "vision_tower.embeddings.patch_embedding.weight" in a
    assert "multi_modal_projector.mm_input_projection_weight" in a
    assert "model.language_model.embed_tokens.weight" in b
    assert "model.vision_tower.embeddings.patch_embedding.weight" in b
    assert not any("head." in n for n in b if "vision" in n)


@pytest.mark.parametrize("name", MODELS)
def test_text_logits_equal_transformers(hf_dirs, name):
    folder, m = hf_dirs[name]
    cfg = jobs.open_checkpoint(folder).config
    assert type(cfg) is Gemma3MMConfig and cfg.final_logit_softcapping == 30.0
    assert_logits(folder, torch_logits(m))


def test_the_wrapper_applies_no_final_softcap(hf_dirs, monkeypatch):
    """transformers' wrapper never applies text_config.final_logit_softcapping (30 here), which
    its Gemma3ForCausalLM applies: our wrapper with the text model's soft-cap is far off."""
    folder, m = hf_dirs["hf_names"]
    want = torch_logits(m)
    cfg, params = read_params(folder)
    np.testing.assert_allclose(forward(cfg, params), want, atol=1e-4, rtol=0)
    monkeypatch.setattr(Gemma3MM, "final_softcap", lambda self: self.cfg.final_logit_softcapping)
    assert_far(forward(cfg, params), want)


def test_the_text_model_is_the_gemma3_family(hf_dirs):
    """The text params are Gemma 3's tree (the gemma3 module runs them) and the carried parts sit
    beside them; the vision tensors reach the tree unchanged."""
    folder, m = hf_dirs["hf_names"]
    cfg, params = read_params(folder)
    text_cfg = models.config_from_hf(m.config.text_config.to_dict())
    assert models.family_of(text_cfg).name == "gemma3"
    text_tree = models.param_shape_tree(text_cfg)
    assert {k: v for k, v in models.param_shape_tree(cfg).items() if k in text_tree} == text_tree
    assert set(params) == {*text_tree, "vision", "projector"}
    sd = m.state_dict()
    assert np.array_equal(params["vision"]["encoder"]["fc1"]["weight"][1],
                          sd["model.vision_tower.encoder.layers.1.mlp.fc1.weight"].numpy())  # fmt: skip
    assert np.array_equal(params["projector"]["input"]["weight"],
                          sd["model.multi_modal_projector.mm_input_projection_weight"].numpy())  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_import_restore_export_is_bitwise_and_loads_in_transformers(hf_dirs, tmp_path, name):
    folder, m = hf_dirs[name]
    out = roundtrip_bitwise(folder, tmp_path)
    assert _names(out) == _names(folder)  # the vision tower and projector under their names
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    vision = [
        {k: v for k, v in c.vision_config.to_dict().items() if k != "dtype"}
        for c in (back.config, m.config)
    ]
    assert vision[0] == vision[1]
    for key in ("mm_tokens_per_image", "image_token_index", "boi_token_index", "eoi_token_index"):
        assert getattr(back.config, key) == getattr(m.config, key), key
    np.testing.assert_array_equal(torch_logits(back), torch_logits(m))


def test_config_read_and_written(hf_dirs):
    folder, m = hf_dirs["hf_names"]
    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    cfg = models.config_from_hf(d)
    assert (
        cfg.vision_hidden_size,
        cfg.vision_num_layers,
        cfg.vision_positions,
        cfg.vision_use_head,
    ) == (16, 2, 4, True)
    assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
    back = models.config_to_hf(cfg)
    assert models.config_from_hf(back) == cfg
    assert {k: v for k, v in back.items() if k != "text_config"} == {
        k: v for k, v in d.items() if k != "text_config"
    }
    with pytest.raises(
        ConfigError, match="c.json: Gemma3ForConditionalGeneration needs a text_config"
    ):
        models.config_from_hf({**d, "text_config": None}, source="c.json")
    with pytest.raises(
        ConfigError, match="c.json: .*vision image_size 8 is not a multiple of patch_size 3"
    ):
        models.config_from_hf(
            {**d, "vision_config": {**d["vision_config"], "patch_size": 3}}, source="c.json"
        )


def test_a_sparse_text_config_is_read_with_transformers_defaults():
    """google/gemma-3-4b-it's config.json gives only some text sizes; transformers fills the rest
    from Gemma3TextConfig's defaults, and so do we."""
    sparse = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
              "sliding_window": 1024}  # fmt: skip
    vision = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}  # fmt: skip
    d = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
         "text_config": sparse, "vision_config": vision}  # fmt: skip
    cfg = models.config_from_hf(d)
    theirs = transformers.Gemma3Config(
        **{k: v for k, v in d.items() if k != "architectures"}
    ).text_config
    assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)  # fmt: skip
    assert dict(cfg.rope_scaling)["factor"] == 8.0 and cfg.vision_positions == 64 * 64


def test_the_prefixes_matter(hf_dirs):
    """Read with the other spelling's prefixes, the checkpoint's names map to nothing: one
    MappingError naming them (so `fit_to_hf_names` really chose the prefixes)."""
    folder, _ = hf_dirs["module_names_no_pool_head"]
    opened = jobs.open_checkpoint(folder)
    assert (opened.config.text_prefix, opened.config.vision_prefix) == (
        "model.language_model.",
        "model.vision_tower.",
    )
    wrong = models.family_of(opened.config).fit_to_hf_names(
        opened.config,
        {
            "language_model.model.embed_tokens.weight",
            "vision_tower.embeddings.patch_embedding.weight",
        },
    )
    assert wrong.text_prefix == "language_model.model." and wrong.vision_prefix == "vision_tower."
    with pytest.raises(MappingError, match="model.language_model"):
        naming.hf_to_tree(opened.named, wrong)
    with pytest.raises(ConfigError, match="text_prefix: 'lm.'; expected one of"):
        models.config_from_dict({**models.config_to_dict(opened.config), "text_prefix": "lm."})
