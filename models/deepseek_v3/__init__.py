"""The DeepSeek V3 family: `config.py` (DeepseekV3Config, HF form, rule variables, param shapes;
no JAX), `routing.py` (the router), `module.py` (the Flax module), `hf.rules` (HF names ->
params tree, dense / MoE / MTP layer groups by index lists)."""

from __future__ import annotations

from hybridckpt.models.deepseek_v3 import config
from hybridckpt.models.family import Family

FAMILY = Family(
    name="deepseek_v3",
    config_cls=config.DeepseekV3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    shape_tree=config.shape_tree,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.deepseek_v3.module:DeepseekV3",
    hf_rules=f"{__name__}:hf.rules",
    hf_name_fixes=config.hf_name_fixes,
    fit_to_hf_names=config.fit_to_hf_names,
)
