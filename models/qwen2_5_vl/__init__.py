"""The Qwen2.5-VL wrapper (`Qwen2_5_VLForConditionalGeneration`): `config.py` (Qwen2_5_VLConfig:
Qwen2's config plus M-RoPE's section, the vision tower's sizes, the name prefixes and the rest
of its config.json, read through `models.qwen3_vl.wrapper`; no JAX), `params.py` (Qwen2's text
rows under the wrapper's prefix, the vision tower). The Flax module is Qwen3-VL's
(`models.qwen3_vl.module.QwenVL`: the Qwen2 block, as the config says, with chunked M-RoPE)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen2_5_vl import config, params

FAMILY = Family(
    name="qwen2_5_vl",
    config_cls=config.Qwen2_5_VLConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.WRAPPER.model_type,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen3_vl.module:QwenVL",
    fit_to_hf_names=config.fit_to_hf_names,
)
