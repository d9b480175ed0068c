"""The DeepSeek V3.2 family: DeepSeek V3 (`models.deepseek_v3`) plus the lightning indexer.
`config.py` (DeepseekV32Config, HF form, rule variables; no JAX), `params.py` (V3's table with
the indexer's rows), `indexer.py` (the key selection), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.deepseek_v3 import config as v3
from hybridckpt.models.deepseek_v32 import config, params
from hybridckpt.models.family import Family

FAMILY = Family(
    name="deepseek_v32",
    config_cls=config.DeepseekV32Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.deepseek_v32.module:DeepseekV32",
    hf_name_fixes=v3.hf_name_fixes,
    fit_to_hf_names=v3.fit_to_hf_names,
)
