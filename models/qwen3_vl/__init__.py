"""The Qwen3-VL wrapper (`Qwen3VLForConditionalGeneration`): `config.py` (Qwen3VLConfig: Qwen3's
config plus M-RoPE's section, the vision tower's sizes, the checkpoint's name prefixes and the
rest of its config.json; no JAX), `wrapper.py` (the HF config and names the Qwen-VL wrappers
share; Qwen2.5-VL's family reuses it), `mrope.py` (M-RoPE), `params.py` (the param table: Qwen3's
text rows under the wrapper's prefix, the vision tower with its DeepStack mergers), `module.py`
(the Flax module: the text forward with M-RoPE; the tower is carried, not run)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen3_vl import config, params

FAMILY = Family(
    name="qwen3_vl",
    config_cls=config.Qwen3VLConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.WRAPPER.model_type,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen3_vl.module:QwenVL",
    fit_to_hf_names=config.fit_to_hf_names,
)
