"""The ERNIE 4.5 dense family (Ernie4_5ForCausalLM): Llama's block with interleaved RoPE and
optional biases on every projection. `config.py` (Ernie45Config, HF form, rule variables; no JAX),
`params.py` (the param table), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.ernie4_5 import config, params
from hybridckpt.models.family import Family

FAMILY = Family(
    name="ernie4_5",
    config_cls=config.Ernie45Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.ernie4_5.module:Ernie45",
)
