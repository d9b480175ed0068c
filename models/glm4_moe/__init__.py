"""The GLM-4.5 family (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6): `config.py`
(Glm4MoeConfig, HF form, rule variables; no JAX), `params.py` (the param table: dense / MoE / MTP
layer groups by index lists), `module.py` (the Flax module; DeepSeek V3's router and MoE under a
GQA attention with biases, per-head q/k norm and partial rotary)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.glm4_moe import config, params

FAMILY = Family(
    name="glm4_moe",
    config_cls=config.Glm4MoeConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.glm4_moe.module:Glm4Moe",
    hf_name_fixes=config.hf_name_fixes,
    fit_to_hf_names=config.fit_to_hf_names,
)
