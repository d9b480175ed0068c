"""The DeepSeek V3 family: `config.py` (DeepseekV3Config, HF form, rule variables; no JAX),
`params.py` (the param table: dense / MoE / MTP layer groups by index lists), `routing.py` (the
router), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.deepseek_v3 import config, params
from hybridckpt.models.family import Family

FAMILY = Family(
    name="deepseek_v3",
    config_cls=config.DeepseekV3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.deepseek_v3.module:DeepseekV3",
    hf_name_fixes=config.hf_name_fixes,
    fit_to_hf_names=config.fit_to_hf_names,
)
