"""The OLMo 2 family: `config.py` (Olmo2Config, HF form, rule variables; no JAX), `params.py`
(the param table), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.olmo2 import config, params

FAMILY = Family(
    name="olmo2",
    config_cls=config.Olmo2Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("olmo2",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.olmo2.module:Olmo2",
)
