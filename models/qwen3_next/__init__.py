"""The Qwen3-Next family (`Qwen3NextForCausalLM`): `config.py` (Qwen3NextConfig: Qwen3-MoE's
config plus the gated delta net's sizes, the per-layer kinds, the rotary fraction and the
shared expert; no JAX), `params.py` (the param table: per-kind groups stacked by index lists),
`delta.py` (the gated delta net in JAX), `module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen3_next import config, params

FAMILY = Family(
    name="qwen3_next",
    config_cls=config.Qwen3NextConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("qwen3_next",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen3_next.module:Qwen3Next",
    hf_name_fixes=config.hf_name_fixes,
)
