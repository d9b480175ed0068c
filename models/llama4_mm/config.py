"""Llama 4 multimodal (`Llama4ForConditionalGeneration`) config and its HF form (no JAX).

The HF `config.json` (huggingface/transformers:src/transformers/models/llama4/
configuration_llama4.py `Llama4Config`, model_type "llama4") nests the text model's config under
`text_config` (a Llama4TextConfig: read by `models.llama4.config`, the text family's reader) and
the vision tower's under `vision_config` (a Llama4VisionConfig), beside the image tokens' keys.

What is kept:
- the text model: every Llama4Config field (the forward is Llama 4's); the head is tied when
  `text_config.tie_word_embeddings` says so (the text model's own config ties it in
  transformers; false in the releases);
- the vision tower's sizes, for its params' shapes (`vision_config`: hidden_size,
  intermediate_size, num_hidden_layers, num_channels, image_size, patch_size, vision_output_dim,
  projector_input_dim, projector_output_dim, with Llama4VisionConfig's defaults 768, 5632, 34,
  3, 448, 14, 7680, 4096, 4096 where absent); its position table has
  (image_size // patch_size) ** 2 + 1 rows (the patches and the class token);
- every other top-level key as read (`hf_rest`, the JSON text of that object, `vision_config`
  included), written back unchanged by `to_hf`, so the export's config.json is the source's
  (the text config rewritten by the text family).
Tensor names (the releases and transformers 4.5x-5.24 `save_pretrained`, with or without
`save_original_format`): text `language_model.model.*` and `language_model.lm_head.weight`,
tower `vision_model.*`, projector `multi_modal_projector.linear_1.weight`.
No vision forward: the tower and projector are params carried through import, restore and
export bit for bit; `forward` computes the text model's logits (what the wrapper computes with
no image).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import check_json_object
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama4 import config as text

ARCHITECTURE = "Llama4ForConditionalGeneration"
MODEL_TYPE = "llama4"
# transformers 5.24 Llama4VisionConfig's defaults of the sizes kept (field -> (key, default))
VISION_KEYS = {"vision_hidden_size": ("hidden_size", 768), "vision_intermediate_size": ("intermediate_size", 5632),
               "vision_num_layers": ("num_hidden_layers", 34), "vision_num_channels": ("num_channels", 3),
               "vision_image_size": ("image_size", 448), "vision_patch_size": ("patch_size", 14),
               "vision_output_dim": ("vision_output_dim", 7680),
               "projector_input_dim": ("projector_input_dim", 4096),
               "projector_output_dim": ("projector_output_dim", 4096)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Llama4MMConfig(text.Llama4Config):
    """Llama 4 multimodal: the text model's Llama4Config fields, plus the vision tower's sizes
    and `hf_rest` (the JSON text of the config.json keys beside `text_config`, kept as read).
    See the module docstring."""

    vision_hidden_size: int = 1408
    vision_intermediate_size: int = 5632
    vision_num_layers: int = 34
    vision_num_channels: int = 3
    vision_image_size: int = 336
    vision_patch_size: int = 14
    vision_output_dim: int = 4096
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    hf_rest: str = "{}"

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        for name in VISION_KEYS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 31:
                raise ConfigError(f"{where}.{name}: expected a positive int, found {v!r:.60}")
        if self.vision_patch_size > self.vision_image_size:
            raise ConfigError(f"{where}: vision patch_size {self.vision_patch_size} exceeds image_size "
                              f"{self.vision_image_size}")  # fmt: skip
        check_json_object(self)

    @property
    def family(self) -> str:
        return "llama4_mm"

    @property
    def vision_positions(self) -> int:
        """Rows of the tower's position table: (image_size // patch_size) ** 2 patches + the
        class token (`Llama4VisionModel.num_patches`)."""
        return (self.vision_image_size // self.vision_patch_size) ** 2 + 1


def _vision(v: Any, source: str) -> dict[str, Any]:
    if v is None:
        v = {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"{source}: vision_config must be an object, found {v!r:.60}")
    return {field: v.get(key, default) for field, (key, default) in VISION_KEYS.items()}


def from_hf(d: Mapping[str, Any], source: str) -> Llama4MMConfig:
    """A Llama4MMConfig from an HF `config.json` dict; `source` names the file in errors."""
    tc = d.get("text_config")
    if not isinstance(tc, Mapping):
        raise ConfigError(f"{source}: {ARCHITECTURE} needs a text_config object, found {tc!r:.60}")
    fields = text.text_fields(tc, f"{source}: text_config")
    rest = {k: v for k, v in d.items() if k not in ("text_config", "architectures", "model_type")}
    try:
        return Llama4MMConfig(**fields, **_vision(d.get("vision_config"), source),
                              hf_rest=json.dumps(rest, sort_keys=True))  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: Llama4MMConfig) -> dict[str, Any]:
    """The `config.json` dict: the source's keys as read, the text config written by the Llama 4
    text family."""
    rest = json.loads(cfg.hf_rest)
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **rest, "text_config": text.text_to_hf(cfg)}


def rule_variables(cfg: Llama4MMConfig) -> dict[str, Any]:
    """The text family's variables (the wrapper's names are fixed: no prefix variables)."""
    return text.rule_variables(cfg)
