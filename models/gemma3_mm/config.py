"""Gemma 3 multimodal (`Gemma3ForConditionalGeneration`) config and its HF form (no JAX).

The HF `config.json` (huggingface/transformers:src/transformers/models/gemma3/
configuration_gemma3.py `Gemma3Config`, model_type "gemma3") nests the text model's config
under `text_config` (a Gemma3TextConfig: read by `models.gemma3.config.from_hf`, the Gemma 3
text family's reader) and the SigLIP vision tower's under `vision_config`, beside the
projector's and tokens' keys (`mm_tokens_per_image`, `boi_token_index`, ...).

What is kept:
- the text model: every Gemma3Config field (the forward is Gemma 3's); sizes absent from
  `text_config` are Gemma3TextConfig's defaults, as transformers reads them (the released 4B
  config gives no vocab_size, heads or head_dim);
- the vision tower's sizes, for its params' shapes (`vision_config`: hidden_size,
  intermediate_size, num_hidden_layers, num_channels, image_size, patch_size, vision_use_head,
  with transformers' SiglipVisionConfig defaults 768, 3072, 12, 3, 224, 16, true where absent;
  the position table has (image_size / patch_size) ** 2 rows);
- every other top-level key as read (`hf_rest`, the JSON text of that object), written back
  unchanged by `to_hf`, so the export's config.json is the source's (the text config rewritten
  by the text family);
- the name prefixes the checkpoint uses (`fit_to_hf_names` reads them off the tensor names):
  text `language_model.model.` (transformers 4.x and 5.x `save_pretrained`) or
  `model.language_model.` (5.x `save_pretrained(save_original_format=False)`, the module
  tree's own names); tower `vision_tower.vision_model.` (4.x), `vision_tower.` (5.x),
  `model.vision_tower.` (5.x unconverted) or `model.vision_tower.vision_model.`; projector
  `multi_modal_projector.` or `model.multi_modal_projector.`; head `language_model.lm_head.weight`
  or `lm_head.weight`. The export writes the names it read.
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
from hybridckpt.models.gemma2.config import rule_variables as text_rule_variables
from hybridckpt.models.gemma3 import config as text

ARCHITECTURE = "Gemma3ForConditionalGeneration"
MODEL_TYPE = "gemma3"
# transformers' SiglipVisionConfig defaults (a vision_config dict is read by it)
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "vision_use_head": True}  # fmt: skip
# transformers' Gemma3TextConfig defaults of the sizes (Gemma 3 4B-27B's config.json gives a sparse
# text_config: the 4B one has no vocab_size, heads or head_dim, which transformers fills so)
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                 "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 256}  # fmt: skip
# the spellings each part's prefix has in the files the tools write (first: transformers'
# save_pretrained default)
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
VISION_PREFIXES = ("vision_tower.", "vision_tower.vision_model.", "model.vision_tower.",
                   "model.vision_tower.vision_model.")  # fmt: skip
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
HEAD_NAMES = ("language_model.lm_head.weight", "lm_head.weight")
# the tensor each prefix is read off
MARKERS = {"text_prefix": ("embed_tokens.weight", TEXT_PREFIXES),
           "vision_prefix": ("embeddings.patch_embedding.weight", VISION_PREFIXES),
           "projector_prefix": ("mm_input_projection_weight", PROJECTOR_PREFIXES)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Gemma3MMConfig(text.Gemma3Config):
    """Gemma 3 multimodal: the text model's Gemma3Config fields, plus the vision tower's sizes
    (`vision_*`), the name prefixes of the checkpoint and `hf_rest` (the JSON text of the
    config.json keys beside `text_config`, kept as read). See the module docstring."""

    vision_hidden_size: int = 1152
    vision_intermediate_size: int = 4304
    vision_num_layers: int = 27
    vision_num_channels: int = 3
    vision_image_size: int = 896
    vision_patch_size: int = 14
    vision_use_head: bool = False
    text_prefix: str = TEXT_PREFIXES[0]
    vision_prefix: str = VISION_PREFIXES[1]
    projector_prefix: str = PROJECTOR_PREFIXES[0]
    head_name: str = HEAD_NAMES[0]
    hf_rest: str = "{}"

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        for name in ("vision_hidden_size", "vision_intermediate_size", "vision_num_layers",
                     "vision_num_channels", "vision_image_size", "vision_patch_size"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{where}.{name}: expected a positive int, found {v!r:.60}")
        if self.vision_image_size % self.vision_patch_size:
            raise ConfigError(f"{where}: vision image_size {self.vision_image_size} is not a multiple "
                              f"of patch_size {self.vision_patch_size}")  # fmt: skip
        object.__setattr__(self, "vision_use_head", bool(self.vision_use_head))
        for name, allowed in (("text_prefix", TEXT_PREFIXES), ("vision_prefix", VISION_PREFIXES),
                              ("projector_prefix", PROJECTOR_PREFIXES), ("head_name", HEAD_NAMES)):  # fmt: skip
            check_choice(self, name, allowed)
        check_json_object(self)

    @property
    def family(self) -> str:
        return "gemma3_mm"

    @property
    def vision_positions(self) -> int:
        """Rows of the tower's position table: (image_size / patch_size) ** 2 patches."""
        return (self.vision_image_size // self.vision_patch_size) ** 2


def _vision(v: Any, source: str) -> dict[str, Any]:
    if v is None:
        v = {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"{source}: vision_config must be an object, found {v!r:.60}")
    got = {k: v.get(k, VISION_DEFAULTS[k]) for k in VISION_DEFAULTS}
    return {
        "vision_hidden_size": got["hidden_size"],
        "vision_intermediate_size": got["intermediate_size"],
        "vision_num_layers": got["num_hidden_layers"],
        "vision_num_channels": got["num_channels"],
        "vision_image_size": got["image_size"],
        "vision_patch_size": got["patch_size"],
        "vision_use_head": got["vision_use_head"],
    }


def from_hf(d: Mapping[str, Any], source: str) -> Gemma3MMConfig:
    """A Gemma3MMConfig from an HF `config.json` dict; `source` names the file in errors."""
    tc = d.get("text_config")
    if not isinstance(tc, Mapping):
        raise ConfigError(f"{source}: {ARCHITECTURE} needs a text_config object, found {tc!r:.60}")
    # transformers' Gemma3Config ties the head through its own tie_word_embeddings (default true)
    tc = {**TEXT_DEFAULTS, **tc}
    tc["tie_word_embeddings"] = d.get("tie_word_embeddings", tc.get("tie_word_embeddings", True))
    cfg = text.from_hf(tc, f"{source}: text_config")
    rest = {k: v for k, v in d.items() if k not in ("text_config", "architectures", "model_type")}
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    try:
        return Gemma3MMConfig(**fields, **_vision(d.get("vision_config"), source),
                              hf_rest=json.dumps(rest, sort_keys=True))  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: Gemma3MMConfig) -> dict[str, Any]:
    """The `config.json` dict: the source's keys as read, the text config written by the Gemma 3
    text family (its `architectures` left out, as transformers nests it)."""
    tc = text.to_hf(cfg)
    del tc["architectures"]
    rest = json.loads(cfg.hf_rest)
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **rest, "text_config": tc,
            "tie_word_embeddings": cfg.tie_word_embeddings}  # fmt: skip


def fit_to_hf_names(cfg: Gemma3MMConfig, names: Collection[str]) -> Gemma3MMConfig:
    """`cfg` with the prefixes the tensor `names` use (a part whose marker tensor is absent, or
    spelt no known way, keeps cfg's: the rules then report the names they cannot map)."""
    found: dict[str, str] = {}
    for field, (marker, allowed) in MARKERS.items():
        for prefix in allowed:
            if prefix + marker in names:
                found[field] = prefix
    for name in HEAD_NAMES:
        if name in names:
            found["head_name"] = name
    if "head_name" not in found and "text_prefix" in found:
        found["head_name"] = HEAD_NAMES[TEXT_PREFIXES.index(found["text_prefix"])]
    return dataclasses.replace(cfg, **found)


def rule_variables(cfg: Gemma3MMConfig) -> dict[str, Any]:
    """The text family's variables plus the prefixes (`{text}`, `{vision}`, `{projector}`,
    `{head}` in the table's HF names) and `vision_head` (the tower's attention-pooling head)."""
    return text_rule_variables(cfg) | {
        "text": cfg.text_prefix,
        "vision": cfg.vision_prefix,
        "projector": cfg.projector_prefix,
        "head": cfg.head_name,
        "vision_head": cfg.vision_use_head,
    }
