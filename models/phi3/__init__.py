"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini: `Phi3ForCausalLM`): `config.py`
(Phi3Config, HF form, rule variables; no JAX), `rope.py` (partial rotary and longrope
frequencies; no JAX), `params.py` (the param table: fused qkv and gate_up), `module.py` (the
Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.phi3 import config, params

FAMILY = Family(
    name="phi3",
    config_cls=config.Phi3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("phi3",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.phi3.module:Phi3",
)
