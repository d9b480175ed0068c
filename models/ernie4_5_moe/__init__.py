"""The ERNIE 4.5 MoE family (Ernie4_5_MoeForCausalLM): ERNIE 4.5's attention (interleaved RoPE,
optional biases) with a softmax router whose `moe_statics.e_score_correction_bias` only chooses,
shared experts, dense layers outside the MoE layer range. `config.py` (Ernie45MoeConfig, HF form,
rule variables; no JAX), `params.py` (the param table), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.ernie4_5_moe import config, params
from hybridckpt.models.family import Family

FAMILY = Family(
    name="ernie4_5_moe",
    config_cls=config.Ernie45MoeConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.ernie4_5_moe.module:Ernie45Moe",
    hf_name_fixes=config.hf_name_fixes,
    fit_to_hf_names=config.fit_to_hf_names,
)
