"""The Llama family: `config.py` (LlamaConfig, HF and Meta forms, rule variables; no JAX),
`params.py` (the param table: HF names, shapes, axes), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.llama import config, params

FAMILY = Family(
    name="llama",
    config_cls=config.LlamaConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("llama",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.llama.module:Llama",
    config_from_meta=config.config_from_meta_params,
)
