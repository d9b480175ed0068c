"""The Qwen2 / Qwen2.5 family: `config.py` (Qwen2Config, HF form, rule variables; no
JAX), `params.py` (the param table), `module.py` (the Flax module, whose block Qwen3 shares)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen2 import config, params

FAMILY = Family(
    name="qwen2",
    config_cls=config.Qwen2Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("qwen2",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen2.module:Qwen2",
)
