"""The Gemma 3 text family: `config.py` (Gemma3Config, HF form; no JAX),
`params.py` (the param table), `module.py` (the Flax module: Gemma 2's with q/k norms and
local/global RoPE tables). Rule variables are Gemma 2's."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.gemma2.config import rule_variables
from hybridckpt.models.gemma3 import config, params

FAMILY = Family(
    name="gemma3",
    config_cls=config.Gemma3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=rule_variables,
    module="hybridckpt.models.gemma3.module:Gemma3",
)
