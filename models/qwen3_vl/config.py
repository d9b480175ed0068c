"""Qwen3-VL (`Qwen3VLForConditionalGeneration`) config and its HF form (no JAX).

The HF `config.json` (huggingface/transformers:src/transformers/models/qwen3_vl/
configuration_qwen3_vl.py `Qwen3VLConfig`, model_type "qwen3_vl") nests a `Qwen3VLTextConfig`
under `text_config` and a `Qwen3VLVisionConfig` under `vision_config`; read and written as
`models.qwen3_vl.wrapper` says (the text model by the Qwen3 family's reader; transformers'
text defaults where absent: rope_theta 5e5, head_dim 128, mrope_section [24, 20, 20]).

The text model is Qwen3's (`Qwen3VLTextAttention`: per-head q/k RMSNorm, `attention_bias`,
explicit head_dim) with interleaved M-RoPE (`models.qwen3_vl.mrope`; transformers interleaves
for this model whatever `mrope_interleaved` says: the key is kept as read and written back,
`mrope_interleaved` the property says what the forward does). The tower's sizes, for its params'
shapes: depth, hidden_size, intermediate_size, in_channels, patch_size, temporal_patch_size,
spatial_merge_size, out_hidden_size, num_position_embeddings, deepstack_visual_indexes (one
DeepStack merger per index). Names: text `model.language_model.` (transformers 5.24's save, both
formats) or `model.`; tower `model.visual.` or `visual.`; head `lm_head.weight`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.qwen3 import config as text
from hybridckpt.models.qwen3_vl import wrapper

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
# transformers' Qwen3VLTextConfig defaults of what a text_config may leave out
TEXT_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 128,
                 "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 500000.0}  # fmt: skip
# HF vision_config key -> (config field, transformers' Qwen3VLVisionConfig default)
VISION_KEYS = {
    "depth": ("vision_depth", 27),
    "hidden_size": ("vision_hidden_size", 1152),
    "intermediate_size": ("vision_intermediate_size", 4304),
    "in_channels": ("vision_in_channels", 3),
    "patch_size": ("vision_patch_size", 16),
    "temporal_patch_size": ("vision_temporal_patch_size", 2),
    "spatial_merge_size": ("vision_spatial_merge_size", 2),
    "out_hidden_size": ("vision_out_hidden_size", 3584),
    "num_position_embeddings": ("vision_num_position_embeddings", 2304),
    "deepstack_visual_indexes": ("vision_deepstack_layers", (8, 16, 24)),
}
WRAPPER = wrapper.Wrapper(
    architecture=ARCHITECTURE,
    model_type="qwen3_vl",
    text_model_type="qwen3_vl_text",
    text_from_hf=text.from_hf,
    text_to_hf=text.to_hf,
    text_defaults=TEXT_DEFAULTS,
    mrope_default=(24, 20, 20),
    interleaved=True,
    vision_keys=VISION_KEYS,
    text_prefixes=("model.language_model.", "model."),
    vision_prefixes=("model.visual.", "visual."),
    text_ties=False,
    flat_text=False,
)


@dataclasses.dataclass(frozen=True)
class Qwen3VLConfig(text.Qwen3Config):
    """Qwen3-VL: the text model's Qwen3Config fields, M-RoPE's `mrope_section` (and the
    `mrope_interleaved` key as read, None when absent), the tower's sizes (`vision_*`), the
    checkpoint's name prefixes and `hf_rest` (the JSON text of the other top-level keys)."""

    mrope_section: tuple[int, int, int] = (24, 20, 20)
    mrope_interleaved_key: bool | None = None
    vision_depth: int = 27
    vision_hidden_size: int = 1152
    vision_intermediate_size: int = 4304
    vision_in_channels: int = 3
    vision_patch_size: int = 16
    vision_temporal_patch_size: int = 2
    vision_spatial_merge_size: int = 2
    vision_out_hidden_size: int = 3584
    vision_num_position_embeddings: int = 2304
    vision_deepstack_layers: tuple[int, ...] = (8, 16, 24)
    text_prefix: str = WRAPPER.text_prefixes[0]
    vision_prefix: str = WRAPPER.vision_prefixes[0]
    hf_rest: str = "{}"

    def __post_init__(self) -> None:
        super().__post_init__()
        wrapper.check_fields(self, WRAPPER)

    @property
    def family(self) -> str:
        return "qwen3_vl"

    @property
    def mrope_interleaved(self) -> bool:
        """The frequencies' axes interleave T H W (`models.qwen3_vl.mrope`); always, as
        transformers' Qwen3VLTextRotaryEmbedding does."""
        return True

    @property
    def vision_merged_size(self) -> int:
        """Width of the patch merger's input: hidden_size * spatial_merge_size ** 2."""
        return self.vision_hidden_size * self.vision_spatial_merge_size**2


def from_hf(d: Mapping[str, Any], source: str) -> Qwen3VLConfig:
    """A Qwen3VLConfig from an HF `config.json` dict; `source` names the file in errors."""
    return wrapper.read(Qwen3VLConfig, WRAPPER, d, source)


def to_hf(cfg: Qwen3VLConfig) -> dict[str, Any]:
    """The `config.json` dict transformers loads back as a Qwen3VLForConditionalGeneration."""
    return wrapper.write(WRAPPER, cfg)


def fit_to_hf_names(cfg: Qwen3VLConfig, names: Collection[str]) -> Qwen3VLConfig:
    """`cfg` with the name prefixes the tensor `names` use."""
    return wrapper.fit_to_hf_names(WRAPPER, cfg, names)


def rule_variables(cfg: Qwen3VLConfig) -> dict[str, Any]:
    """Qwen3's rule variables plus `{text}` and `{vision}` (the prefixes)."""
    return wrapper.rule_variables(cfg, text.rule_variables)
