"""The Qwen3 (dense) family: `config.py` (Qwen3Config, HF form, rule variables; no
JAX), `params.py` (the param table), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen3 import config, params

FAMILY = Family(
    name="qwen3",
    config_cls=config.Qwen3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("qwen3",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen3.module:Qwen3",
)
