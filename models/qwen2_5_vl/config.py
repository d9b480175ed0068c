"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) config and its HF form (no JAX).

The HF `config.json` (huggingface/transformers:src/transformers/models/qwen2_5_vl/
configuration_qwen2_5_vl.py `Qwen2_5_VLConfig`, model_type "qwen2_5_vl"): transformers 5.x nests a
`Qwen2_5_VLTextConfig` under `text_config`; the released Qwen2.5-VL files are flat (the text keys
at the top level, `rope_scaling: {"type": "mrope", "mrope_section": [16, 24, 24]}`), which
transformers reads as the text config; both are read, as `models.qwen3_vl.wrapper` says (the
text model by the Qwen2 family's reader: qkv biases, no q/k norm; transformers' text defaults
where absent: rope_theta 1e6, rms_norm_eps 1e-5, mrope_section [16, 24, 24]); the export writes
the nested form. A text config's `tie_word_embeddings: true` ties the head (transformers 5's
`Qwen2_5_VLConfig.__post_init__` forwards it; Qwen2.5-VL-3B ties).

The text model's RoPE is chunked M-RoPE (`models.qwen3_vl.mrope`: the first t frequencies by
the temporal positions, the next h by height, the last w by width). The tower's sizes, for its
params' shapes: depth, hidden_size, intermediate_size, in_channels, patch_size,
temporal_patch_size, spatial_merge_size, out_hidden_size. Names: text `model.` (transformers
5.24's default save, and the released files) or `model.language_model.`
(`save_original_format=False`); tower `visual.` or `model.visual.`; head `lm_head.weight`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.qwen2 import config as text
from hybridckpt.models.qwen3_vl import wrapper

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# transformers' Qwen2_5_VLTextConfig defaults of what a text config may leave out
TEXT_DEFAULTS = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                 "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0}  # fmt: skip
# HF vision_config key -> (config field, transformers' Qwen2_5_VLVisionConfig default)
VISION_KEYS = {
    "depth": ("vision_depth", 32),
    "hidden_size": ("vision_hidden_size", 3584),
    "intermediate_size": ("vision_intermediate_size", 3420),
    "in_channels": ("vision_in_channels", 3),
    "patch_size": ("vision_patch_size", 14),
    "temporal_patch_size": ("vision_temporal_patch_size", 2),
    "spatial_merge_size": ("vision_spatial_merge_size", 2),
    "out_hidden_size": ("vision_out_hidden_size", 3584),
}
WRAPPER = wrapper.Wrapper(
    architecture=ARCHITECTURE,
    model_type="qwen2_5_vl",
    text_model_type="qwen2_5_vl_text",
    text_from_hf=text.from_hf,
    text_to_hf=text.to_hf,
    text_defaults=TEXT_DEFAULTS,
    mrope_default=(16, 24, 24),
    interleaved=False,
    vision_keys=VISION_KEYS,
    text_prefixes=("model.", "model.language_model."),
    vision_prefixes=("visual.", "model.visual."),
    text_ties=True,
    flat_text=True,
)


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLConfig(text.Qwen2Config):  # noqa: N801 (transformers' name)
    """Qwen2.5-VL: the text model's Qwen2Config fields, M-RoPE's `mrope_section` (and an
    `mrope_interleaved` key as read, None when absent; unused by transformers here), the tower's
    sizes (`vision_*`), the checkpoint's name prefixes and `hf_rest`."""

    mrope_section: tuple[int, int, int] = (16, 24, 24)
    mrope_interleaved_key: bool | None = None
    vision_depth: int = 32
    vision_hidden_size: int = 3584
    vision_intermediate_size: int = 3420
    vision_in_channels: int = 3
    vision_patch_size: int = 14
    vision_temporal_patch_size: int = 2
    vision_spatial_merge_size: int = 2
    vision_out_hidden_size: int = 3584
    text_prefix: str = WRAPPER.text_prefixes[0]
    vision_prefix: str = WRAPPER.vision_prefixes[0]
    hf_rest: str = "{}"

    def __post_init__(self) -> None:
        super().__post_init__()
        wrapper.check_fields(self, WRAPPER)

    @property
    def family(self) -> str:
        return "qwen2_5_vl"

    @property
    def mrope_interleaved(self) -> bool:
        """False: the frequencies are chunked by `mrope_section` (`models.qwen3_vl.mrope`)."""
        return False

    @property
    def vision_merged_size(self) -> int:
        """Width of the patch merger's input: hidden_size * spatial_merge_size ** 2."""
        return self.vision_hidden_size * self.vision_spatial_merge_size**2


def from_hf(d: Mapping[str, Any], source: str) -> Qwen2_5_VLConfig:
    """A Qwen2_5_VLConfig from an HF `config.json` dict (nested or flat)."""
    return wrapper.read(Qwen2_5_VLConfig, WRAPPER, d, source)


def to_hf(cfg: Qwen2_5_VLConfig) -> dict[str, Any]:
    """The `config.json` dict transformers loads back as a Qwen2_5_VLForConditionalGeneration."""
    return wrapper.write(WRAPPER, cfg)


def fit_to_hf_names(cfg: Qwen2_5_VLConfig, names: Collection[str]) -> Qwen2_5_VLConfig:
    """`cfg` with the name prefixes the tensor `names` use."""
    return wrapper.fit_to_hf_names(WRAPPER, cfg, names)


def rule_variables(cfg: Qwen2_5_VLConfig) -> dict[str, Any]:
    """Qwen2's rule variables plus `{text}` and `{vision}` (the prefixes)."""
    return wrapper.rule_variables(cfg, text.rule_variables)
