"""Mistral 3 (`Mistral3ForConditionalGeneration`) config and its HF form (no JAX).

The HF `config.json` (huggingface/transformers:src/transformers/models/mistral3/
configuration_mistral3.py `Mistral3Config`, model_type "mistral3") nests the text model's config
under `text_config` (a MistralConfig, model_type "mistral": read by `models.mistral.config`, so
head_dim apart from hidden / heads (128 for 5120 / 32) and rope theta 1e9 are Mistral's) and the
Pixtral vision tower's under `vision_config`, beside the projector's keys
(`multimodal_projector_bias`, `spatial_merge_size`, `vision_feature_layer`, ...). As
transformers' `SubConfigSpec.create_subconfig` does, a sub-config given as an object takes its
own class's defaults for absent keys (MistralConfig's, PixtralVisionConfig's); one absent or null
takes Mistral3Config's `init_kwargs` (Mistral-Small-3.1's sizes).

Tied or not: transformers 5.24 ties the head by the TOP-LEVEL `tie_word_embeddings`
(`PreTrainedModel.get_expanded_tied_weights_keys` reads `self.config.tie_word_embeddings`; the
text_config's own key is never read), whose Mistral3Config default is true: a config.json
without the key means tied. When the checkpoint nevertheless holds a head tensor,
transformers' `tie_weights` keeps it (a head that differs from the embedding is not tied, with a
warning; one equal to it gives the same numbers), so `fit_to_hf_names` reads such a checkpoint
as untied and the export says `tie_word_embeddings: false`.

What is kept:
- the text model: every MistralConfig field (the forward is Mistral's);
- the tower's sizes, for its params' shapes (`vision_config`: hidden_size, intermediate_size,
  num_hidden_layers, num_channels, patch_size) and the projector's (`spatial_merge_size`, the
  number of `vision_feature_layer`s, `multimodal_projector_bias`);
- every other top-level key as read (`hf_rest`, the JSON text of that object, `vision_config`
  included), written back unchanged by `to_hf`;
- the name prefixes the checkpoint uses (`fit_to_hf_names` reads them off the tensor names): text
  `language_model.model.` (the Hub's releases and 5.24's default `save_pretrained`) or
  `model.language_model.` (`save_original_format=False`, the module tree's names); tower
  `vision_tower.` or `model.vision_tower.`; projector `multi_modal_projector.` or
  `model.multi_modal_projector.`; head `language_model.lm_head.weight` or `lm_head.weight`.
  The export writes the names it read.
No vision forward: the tower and projector are params carried through import, restore and
export bit for bit; `forward` computes the text model's logits (what the wrapper computes with
no image).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.config_checks import check_choice, check_json_object
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.mistral import config as text

ARCHITECTURE = "Mistral3ForConditionalGeneration"
MODEL_TYPE = "mistral3"
# Mistral3Config.sub_configs_defaults' init_kwargs: the sub-configs of a config.json that has none
TEXT_INIT = {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
             "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
             "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1e9,
             "sliding_window": None, "vocab_size": 131072}  # fmt: skip
VISION_INIT = {"intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 1540,
               "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64, "hidden_act": "gelu"}  # fmt: skip
# PixtralVisionConfig's defaults (a vision_config object is read by it)
VISION_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_channels": 3,
                   "patch_size": 16}  # fmt: skip
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
VISION_PREFIXES = ("vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
HEAD_NAMES = ("language_model.lm_head.weight", "lm_head.weight")
# the tensor each prefix is read off
MARKERS = {"text_prefix": ("embed_tokens.weight", TEXT_PREFIXES),
           "vision_prefix": ("patch_conv.weight", VISION_PREFIXES),
           "projector_prefix": ("linear_1.weight", PROJECTOR_PREFIXES)}  # fmt: skip
_SIZES = ("vision_hidden_size", "vision_intermediate_size", "vision_num_layers", "vision_num_channels",
          "vision_patch_size", "spatial_merge_size", "num_feature_layers")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Mistral3Config(text.MistralConfig):
    """Mistral 3: the text model's MistralConfig fields, plus the Pixtral tower's sizes
    (`vision_*`), the projector's (`spatial_merge_size`, `num_feature_layers`, `projector_bias`),
    the checkpoint's name prefixes and `hf_rest` (the JSON text of the config.json keys beside
    `text_config`, kept as read). See the module docstring."""

    sliding_window: int | None = None
    tie_word_embeddings: bool = True
    vision_hidden_size: int = 1024
    vision_intermediate_size: int = 4096
    vision_num_layers: int = 24
    vision_num_channels: int = 3
    vision_patch_size: int = 14
    spatial_merge_size: int = 2
    num_feature_layers: int = 1
    projector_bias: bool = False
    text_prefix: str = TEXT_PREFIXES[0]
    vision_prefix: str = VISION_PREFIXES[0]
    projector_prefix: str = PROJECTOR_PREFIXES[0]
    head_name: str = HEAD_NAMES[0]
    hf_rest: str = "{}"

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        for name in _SIZES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
                raise ConfigError(
                    f"{where}.{name}: expected a positive int of at most {1 << 20}, found {v!r:.60}"
                )
        object.__setattr__(self, "projector_bias", bool(self.projector_bias))
        for name, allowed in (("text_prefix", TEXT_PREFIXES), ("vision_prefix", VISION_PREFIXES),
                              ("projector_prefix", PROJECTOR_PREFIXES), ("head_name", HEAD_NAMES)):  # fmt: skip
            check_choice(self, name, allowed)
        check_json_object(self)

    @property
    def family(self) -> str:
        return "mistral3"


def _sub(d: Mapping[str, Any], key: str, kind: str, init: dict, source: str) -> dict[str, Any]:
    """The sub-config `key` as transformers builds it: an object as given, absent/null its
    `init` kwargs; its model_type (default `kind`) must be `kind`."""
    sub = d.get(key)
    if sub is None:
        sub = init
    if not isinstance(sub, Mapping):
        raise ConfigError(f"{source}: {key} must be an object or null, found {sub!r:.60}")
    found = sub.get("model_type", kind)
    if found != kind:
        raise ConfigError(
            f"{source}: {key}.model_type {found!r:.60} is not supported for {ARCHITECTURE}; expected {kind!r}"
        )
    return dict(sub)


def _feature_layers(v: Any, source: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return 1
    if isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return len(v)
    raise ConfigError(
        f"{source}: vision_feature_layer: expected an int or a list of ints, found {v!r:.60}"
    )


def from_hf(d: Mapping[str, Any], source: str) -> Mistral3Config:
    """A Mistral3Config from an HF `config.json` dict; `source` names the file in errors."""
    tc = _sub(d, "text_config", "mistral", TEXT_INIT, source)
    vc = _sub(d, "vision_config", "pixtral", VISION_INIT, source)
    # the top-level key ties the head, true when absent (module docstring)
    tc["tie_word_embeddings"] = d.get("tie_word_embeddings", True)
    cfg = text.from_hf(tc, f"{source}: text_config")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    got = {k: vc.get(k, VISION_DEFAULTS[k]) for k in VISION_DEFAULTS}
    skip = ("text_config", "architectures", "model_type", "tie_word_embeddings")
    rest = {k: v for k, v in d.items() if k not in skip}
    try:
        return Mistral3Config(
            **fields,
            vision_hidden_size=got["hidden_size"],
            vision_intermediate_size=got["intermediate_size"],
            vision_num_layers=got["num_hidden_layers"],
            vision_num_channels=got["num_channels"],
            vision_patch_size=got["patch_size"],
            spatial_merge_size=d.get("spatial_merge_size", 2),
            num_feature_layers=_feature_layers(d.get("vision_feature_layer", -1), source),
            projector_bias=bool(d.get("multimodal_projector_bias", False)),
            hf_rest=json.dumps(rest, sort_keys=True),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: Mistral3Config) -> dict[str, Any]:
    """The `config.json` dict: the source's keys as read, the text config written by the Mistral
    family (its `architectures` left out, as transformers nests it), the head's tying explicit."""
    tc = text.to_hf(cfg)
    del tc["architectures"]
    rest = json.loads(cfg.hf_rest)
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **rest, "text_config": tc,
            "tie_word_embeddings": cfg.tie_word_embeddings}  # fmt: skip


def fit_to_hf_names(cfg: Mistral3Config, names: Collection[str]) -> Mistral3Config:
    """`cfg` with the prefixes the tensor `names` use (a part whose marker tensor is absent, or
    spelt no known way, keeps cfg's: the rules then report the names they cannot map), untied
    when a head tensor is there (as transformers keeps it; module docstring)."""
    found: dict[str, Any] = {}
    for field, (marker, allowed) in MARKERS.items():
        for prefix in allowed:
            if prefix + marker in names:
                found[field] = prefix
    for name in HEAD_NAMES:
        if name in names:
            found["head_name"] = name
            found["tie_word_embeddings"] = False
    if "head_name" not in found and "text_prefix" in found:
        found["head_name"] = HEAD_NAMES[TEXT_PREFIXES.index(found["text_prefix"])]
    return dataclasses.replace(cfg, **found)


def rule_variables(cfg: Mistral3Config) -> dict[str, Any]:
    """Mistral's variables plus the prefixes (`{text}`, `{vision}`, `{projector}`, `{head}` in
    the table's HF names) and `projector_bias`."""
    return text.rule_variables(cfg) | {
        "text": cfg.text_prefix,
        "vision": cfg.vision_prefix,
        "projector": cfg.projector_prefix,
        "head": cfg.head_name,
        "projector_bias": cfg.projector_bias,
    }
