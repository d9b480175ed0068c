"""The GPT-2 family: `config.py` (GPT2Config, HF form, rule variables, HF name fixes; no
JAX), `params.py` (the param table), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.gpt2 import config, params

FAMILY = Family(
    name="gpt2",
    config_cls=config.GPT2Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("gpt2",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.gpt2.module:GPT2",
    hf_name_fixes=config.hf_name_fixes,
)
