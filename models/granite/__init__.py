"""The Granite family (IBM Granite 3.x dense): `config.py` (GraniteConfig, HF form, rule
variables; no JAX), `params.py` (the param table: Llama's), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.granite import config, params

FAMILY = Family(
    name="granite",
    config_cls=config.GraniteConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("granite",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.granite.module:Granite",
)
