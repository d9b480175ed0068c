"""The Gemma 2 family: `config.py` (Gemma2Config, HF form, rule variables; no JAX),
`params.py` (the param table), `module.py` (the Flax module, and how the alternating
local/global layers are stacked). Gemma 3 (`models.gemma3`) builds on these."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.gemma2 import config, params

FAMILY = Family(
    name="gemma2",
    config_cls=config.Gemma2Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("gemma2",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.gemma2.module:Gemma2",
)
